"""Every model family's greedy output and logprobs equal transformers' (teacher forcing, see
ARCHITECTURE.md), float32 on the CPU: tiny random Qwen3, Gemma 3 (text and the text tower of
a multimodal checkpoint), Gemma 2 and Phi-3 configs with the features that set each family apart —
q/k norms, explicit head_dim, sliding-window layers (longer than a block, shorter than the
prompt), Gemma's (1 + w) sandwich norms, GeGLU, scaled embeddings, query_pre_attn_scalar,
per-kind rotary bases and scaling, attention and final soft-capping, fused checkpoints, partial rotary
and LongRoPE. Chunked prefill (a 64-token budget), prefix-cache hits, both CPU attention
paths (C kernel, torch) and bf16 runs are included.

To add a family: add its rows to CONFIGS (the tiny config in ``support/tiny_models.py``)."""

from __future__ import annotations

import math

import pytest
import torch
from support.greedy_reference import (
    check_greedy,
    check_greedy_outputs,
    hf_model,
    reference_prompts,
    teacher_forced_logits,
)
from support.tiny_models import make_tiny_model

from loramux.engine import LLM, SamplingParams

MAX_TOKENS = 12
LONGROPE = dict(
    partial_rotary_factor=0.75, max_position_embeddings=128, original_max_position_embeddings=32,
    rope_scaling=dict(type="longrope", short_factor=[1.0, 1.2, 1.5, 2.0, 2.5, 3.0],
                      long_factor=[3.0, 4.0, 6.0, 8.0, 12.0, 16.0]),
)

CONFIGS = {  # name: (family, overrides)
    "qwen3": ("qwen3", {}),
    "qwen3-windows": ("qwen3", dict(num_hidden_layers=3, use_sliding_window=True, sliding_window=20,
                                    max_window_layers=1)),
    "gemma3": ("gemma3", dict(num_hidden_layers=4, final_logit_softcapping=4.0,
                              rope_scaling={"rope_type": "linear", "factor": 2.0})),
    "gemma3-short-window": ("gemma3", dict(num_hidden_layers=3, sliding_window=7,
                                           sliding_window_pattern=3, query_pre_attn_scalar=64)),
    "gemma3-multimodal": ("gemma3-mm", dict(num_hidden_layers=2, sliding_window=12)),
    "gemma2-softcaps": ("gemma2", dict(num_hidden_layers=3)),
    "phi3": ("phi3", {}),
    "phi3-longrope-partial": ("phi3", LONGROPE),
    "phi3-window": ("phi3", dict(sliding_window=20, num_key_value_heads=4)),
}


@pytest.fixture(scope="module")
def prompts(default_model_dir):
    ids = reference_prompts(default_model_dir)  # the long one: longer than every window and LongRoPE's 32
    assert len(ids[0]) > 40 and len(ids[1]) == 1
    assert all(len(p) + MAX_TOKENS <= 32 for p in ids[1:]), "LongRoPE: short stays short"
    return ids


@pytest.fixture(scope="module")
def family_dir(tmp_path_factory, default_model_dir):
    made = {}

    def make(name):
        if name not in made:
            family, overrides = CONFIGS[name]
            made[name] = make_tiny_model(tmp_path_factory.mktemp(name), default_model_dir, family,
                                         **overrides)
        return made[name]

    return make


def _check_against_reference(ref, prompts, outs, distinct=True):
    check_greedy_outputs(ref, prompts, outs, MAX_TOKENS, distinct=distinct)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_and_logprobs_equal_transformers(name, family_dir, prompts):
    path = family_dir(name)
    # a small token budget staggers admission: prefill chunks and decode rows share steps
    llm = LLM(str(path), dtype="float32", device="cpu", max_model_len=128, max_num_batched_tokens=64)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    _check_against_reference(hf_model(path), prompts, outs)


@pytest.mark.parametrize("name", ["qwen3-windows", "gemma3-short-window", "phi3-longrope-partial"])
def test_prefix_cache_hits_and_torch_attention(name, family_dir, prompts):
    """The second round reuses the first round's blocks (prefix-cache hits, chunks over a
    cached prefix with every layer's window); the torch attention path gives the same."""
    path = family_dir(name)
    ref = hf_model(path)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1)
    for backend in ("auto", "torch"):
        llm = LLM(str(path), dtype="float32", device="cpu", max_model_len=128, max_num_batched_tokens=24,
                  attention_backend=backend)
        first = llm.generate([{"prompt_token_ids": prompts[0][:40]}], params)
        longer = [prompts[0][:40] + prompts[2] + prompts[3]]  # 40 cached tokens: 2 full blocks
        hits = llm.llm_engine.kv.stats.hits
        second = llm.generate([{"prompt_token_ids": p} for p in longer], params)
        assert llm.llm_engine.kv.stats.hits >= hits + 2
        for p, out in ((prompts[0][:40], first[0]), (longer[0], second[0])):
            check_greedy(ref, p, out.outputs[0].token_ids)


def test_longrope_long_prompt_never_reuses_short_prompt_keys(family_dir, prompts):
    """With LongRoPE a prompt past original_max_position_embeddings uses the long factors at
    every position, so it must not take the blocks a short prompt computed (short factors)."""
    path = family_dir("phi3-longrope-partial")
    ref = hf_model(path)
    llm = LLM(str(path), dtype="float32", device="cpu", max_model_len=128)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1)
    short = prompts[0][:18]  # 18 + 12 <= 32: short factors; its first block is cached
    llm.generate([{"prompt_token_ids": short}], params)
    hits = llm.llm_engine.kv.stats.hits
    long = llm.generate([{"prompt_token_ids": prompts[0]}], params)[0]
    assert llm.llm_engine.kv.stats.hits == hits
    _check_against_reference(ref, prompts[:1], [long], distinct=False)
    again = llm.generate([{"prompt_token_ids": prompts[0]}], params)[0]  # same kind: reused
    assert llm.llm_engine.kv.stats.hits > hits
    assert again.outputs[0].token_ids == long.outputs[0].token_ids


def test_longrope_switches_at_the_original_length(family_dir, prompts):
    """A short prompt whose output runs past original_max_position_embeddings switches to the
    long factors at that position: each token's logits equal transformers' forward over the
    cached prefix, one step at a time (what its generate computes for every step but the
    switching one, where Phi-3's generate recomputes the whole cache with the long factors;
    loramux keeps the cached keys, see ``engine/model/rotary.py``)."""
    from transformers import DynamicCache

    path = family_dir("phi3-longrope-partial")
    ref = hf_model(path)
    prompt = prompts[0][:26]  # 26 + 12 crosses 32
    llm = LLM(str(path), dtype="float32", device="cpu", max_model_len=128)
    out = llm.generate([{"prompt_token_ids": prompt}],
                       SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1))
    comp = out[0].outputs[0]
    rows = []
    with torch.no_grad():
        step = ref(torch.tensor([prompt]), cache=DynamicCache(config=ref.config), use_cache=True)
        rows.append(step.logits[0, -1])
        for i, tok in enumerate(comp.token_ids[:-1]):
            step = ref(torch.tensor([[tok]]), cache=step.cache, use_cache=True,
                       position_ids=torch.tensor([[len(prompt) + i]]))
            rows.append(step.logits[0, -1])
    logits = torch.stack(rows).float()
    check_greedy(ref, prompt, comp.token_ids, logits=logits)
    ref_lp = torch.log_softmax(logits.double(), dim=-1)
    for pos, (tok, entry) in enumerate(zip(comp.token_ids, comp.logprobs, strict=True)):
        assert entry[tok].logprob == pytest.approx(ref_lp[pos, tok].item(), abs=1e-4)


@pytest.mark.parametrize("name", ["qwen3", "gemma3", "phi3-longrope-partial"])
def test_bfloat16_runs_close_to_float32(name, family_dir, prompts):
    path = family_dir(name)
    llm = LLM(str(path), dtype="bfloat16", device="cpu", max_model_len=128)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=2)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    ref = hf_model(path)
    for prompt, out in zip(prompts, outs, strict=True):
        comp = out.outputs[0]
        assert all(math.isfinite(e[t].logprob) for t, e in zip(comp.token_ids, comp.logprobs, strict=True))
        logits = teacher_forced_logits(ref, prompt, comp.token_ids[:1])
        probs = torch.softmax(logits[0], dim=-1)
        assert probs[comp.token_ids[0]] >= 0.5 * probs.max()


def test_unsupported_architecture_names_the_supported_ones(tmp_path):
    import json

    from loramux.engine.errors import ModelLoadError

    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"],
                                                      "model_type": "gpt2"}))
    with pytest.raises(ModelLoadError) as e:
        LLM(str(tmp_path), dtype="float32", device="cpu")
    for name in ("GPT2LMHeadModel", "Qwen3ForCausalLM", "Gemma3ForCausalLM",
                 "Gemma3ForConditionalGeneration", "Phi3ForCausalLM", "LlamaForCausalLM"):
        assert name in str(e.value)
