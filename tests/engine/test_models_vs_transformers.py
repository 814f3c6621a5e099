"""Engine greedy decoding on tiny random Llama / Qwen2 / Mistral models equals transformers
(by teacher forcing, see ARCHITECTURE.md), float32 on the CPU; bf16 runs."""

from __future__ import annotations

import math

import pytest
import torch
from support.greedy_reference import check_greedy, teacher_forced_logits
from support.tiny_models import make_tiny_llama

from loramux.engine import LLM, SamplingParams

MAX_TOKENS = 12

CONFIGS = {
    "llama-gqa": dict(architecture="llama"),
    "llama-mha-untied": dict(architecture="llama", num_key_value_heads=4, tie_word_embeddings=False),
    "llama-mqa": dict(architecture="llama", num_attention_heads=8, num_key_value_heads=1),
    "llama3-rope": dict(
        architecture="llama",
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 10000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
    ),
    "qwen2-bias": dict(architecture="qwen2"),
    "mistral-window-headdim": dict(architecture="mistral", sliding_window=16, head_dim=32),
}


@pytest.fixture(scope="module")
def prompts(default_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_model_dir)
    long = (
        "Paged attention stores the keys and values of every sequence in fixed-size blocks, "
        "so that memory is allocated on demand and shared between sequences; the scheduler "
        "admits new requests while others decode, and preempts the newest when blocks run out."
    )
    ids = [
        tok(long).input_ids,  # ~50 tokens: longer than the mistral window
        [tok("Hello").input_ids[0]],  # a single-token prompt
        tok("The capital of France").input_ids,
        tok("def fibonacci(n):\n    if n < 2:\n        return n").input_ids,
    ]
    assert len(ids[0]) > 40 and len(ids[1]) == 1
    assert len({len(p) for p in ids}) == 4
    return ids


def hf_model(path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    model.generation_config.eos_token_id = None  # match ignore_eos
    model.generation_config.pad_token_id = 0
    return model.eval()


@torch.no_grad()
def hf_greedy(model, prompt_ids, n):
    out = model.generate(torch.tensor([prompt_ids]), do_sample=False, max_new_tokens=n)
    return out[0, len(prompt_ids) :].tolist()


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_equals_transformers_by_teacher_forcing(name, tmp_path, default_model_dir, prompts):
    path = make_tiny_llama(tmp_path / name, default_model_dir, **dict(CONFIGS[name]))
    # a small token budget staggers admission: prefill and decode rows share steps
    llm = LLM(str(path), dtype="float32", device="cpu", max_model_len=128, max_num_batched_tokens=64)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    ref = hf_model(path)
    for prompt, out in zip(prompts, outs, strict=True):
        comp = out.outputs[0]
        assert len(comp.token_ids) == MAX_TOKENS and comp.finish_reason == "length"
        logits = check_greedy(ref, prompt, comp.token_ids, reference_ids=hf_greedy(ref, prompt, MAX_TOKENS))
        # logprobs of the chosen tokens are those of the reference's distribution
        ref_lp = torch.log_softmax(logits.double(), dim=-1)
        for pos, (tok, entry) in enumerate(zip(comp.token_ids, comp.logprobs, strict=True)):
            assert entry[tok].logprob == pytest.approx(ref_lp[pos, tok].item(), abs=1e-4)
            assert entry[tok].rank == 1
    # the model is not degenerate: different prompts lead to different continuations
    assert len({tuple(o.outputs[0].token_ids) for o in outs}) > 1


def test_tiny_model_outputs_survive_preemption(tmp_path, default_model_dir, prompts):
    path = make_tiny_llama(tmp_path / "m", default_model_dir)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    batch = [{"prompt_token_ids": p} for p in prompts]
    free = LLM(str(path), dtype="float32", device="cpu", max_model_len=128)
    expected = [o.outputs[0].token_ids for o in free.generate(batch, params)]
    tight = LLM(str(path), dtype="float32", device="cpu", max_model_len=128, block_size=4,
                num_gpu_blocks_override=24)
    got = [o.outputs[0].token_ids for o in tight.generate(batch, params)]
    assert tight.llm_engine.scheduler.num_preemptions > 0
    assert got == expected
    assert tight.llm_engine.kv.num_free_blocks == 24


def test_bfloat16_runs(tmp_path, default_model_dir, prompts):
    path = make_tiny_llama(tmp_path / "bf16", default_model_dir, architecture="qwen2")
    llm = LLM(str(path), dtype="bfloat16", device="cpu", max_model_len=128)
    assert llm.llm_engine.model.dtype == torch.bfloat16
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    sampled = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0.8, top_p=0.9, seed=1)
    )
    ref = hf_model(path)
    for prompt, out in zip(prompts, outs, strict=True):
        comp = out.outputs[0]
        assert len(comp.token_ids) == MAX_TOKENS
        assert all(math.isfinite(e[t].logprob) for t, e in zip(comp.token_ids, comp.logprobs, strict=True))
        # close to the fp32 reference: bf16 rounding only (loose: no tie-level agreement in bf16)
        logits = teacher_forced_logits(ref, prompt, comp.token_ids[:1])
        probs = torch.softmax(logits[0], dim=-1)
        assert probs[comp.token_ids[0]] >= 0.5 * probs.max()
    assert all(len(o.outputs[0].token_ids) > 0 for o in sampled)
