"""The mixture-of-experts families' greedy outputs and logprobs equal transformers' (teacher
forcing, float32, CPU): tiny random Qwen3-MoE (dense ``mlp_only_layers``, ``decoder_sparse_step``,
with and without ``norm_topk_prob``, top-3, a sliding window) and Mixtral configs, from the
per-expert checkpoints ``save_pretrained`` writes and from fused 3-D expert checkpoints; router
ties (every expert's router row equal: the top-k is decided by ``torch.topk``'s tie order alone,
and a wrong choice changes every token); chunked prefill (a 64-token budget) and prefix-cache
hits; attention-only PEFT adapters on MoE bases in a mixed batch with base rows."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file, save_file
from support.greedy_reference import check_greedy, check_greedy_outputs, hf_model, reference_prompts
from support.lora_fixtures import make_peft_adapter
from support.peft_harness import check_rows_match_peft
from support.tiny_models import make_tiny_model

from loramux.engine import LLM, LoRARequest, SamplingParams

MAX_TOKENS = 12
CONFIGS = {  # name: (family, overrides)
    "qwen3_moe": ("qwen3_moe", dict(num_hidden_layers=3, mlp_only_layers=[1])),
    "qwen3_moe-step2-top3": ("qwen3_moe", dict(num_hidden_layers=4, decoder_sparse_step=2,
                                               num_experts_per_tok=3, norm_topk_prob=False)),
    "qwen3_moe-window": ("qwen3_moe", dict(use_sliding_window=True, sliding_window=20)),
    "mixtral": ("mixtral", {}),
    "mixtral-window-top1": ("mixtral", dict(sliding_window=20, num_experts_per_tok=1,
                                            num_local_experts=6)),
}


@pytest.fixture(scope="module")
def prompts(default_model_dir):
    ids = reference_prompts(default_model_dir)
    assert len(ids[0]) > 40
    return ids


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory, default_model_dir):
    made = {}

    def make(name):
        if name not in made:
            family, overrides = CONFIGS[name]
            made[name] = make_tiny_model(tmp_path_factory.mktemp(name), default_model_dir, family,
                                         **overrides)
        return made[name]

    return make


def _generate(path, prompts, **kw):
    llm = LLM(str(path), dtype="float32", device="cpu", max_model_len=128, max_num_batched_tokens=64, **kw)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1)
    return llm, llm.generate([{"prompt_token_ids": p} for p in prompts], params)


def _check(ref, prompts, outs, *, distinct=True):
    check_greedy_outputs(ref, prompts, outs, MAX_TOKENS, distinct=distinct)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_moe_greedy_and_logprobs_equal_transformers(name, moe_dir, prompts):
    path = moe_dir(name)
    _, outs = _generate(path, prompts)
    _check(hf_model(path), prompts, outs)


def _fuse_experts(src, dst):
    """Rewrite a per-expert checkpoint as fused 3-D expert tensors (``mlp.experts.gate_up_proj``
    [E, 2I, H], ``mlp.experts.down_proj`` [E, H, I]), Mixtral's ``block_sparse_moe`` renamed
    ``mlp`` — the layout transformers 5 holds in memory."""
    import shutil

    shutil.copytree(src, dst)
    cfg = json.loads((src / "config.json").read_text())
    mixtral = cfg["model_type"] == "mixtral"
    gate, up, down = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
    sd = load_file(src / "model.safetensors")
    out, experts = {}, {}
    for key, t in sd.items():
        key = key.replace(".block_sparse_moe.", ".mlp.")
        if ".mlp.experts." in key:
            head, rest = key.split(".mlp.experts.")
            e, proj = rest.split(".")[:2]
            experts.setdefault(head, {}).setdefault(proj, {})[int(e)] = t
        else:
            out[key] = t
    for head, projs in experts.items():
        n = len(projs[gate])
        out[f"{head}.mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([projs[gate][e], projs[up][e]]) for e in range(n)])
        out[f"{head}.mlp.experts.down_proj"] = torch.stack([projs[down][e] for e in range(n)])
    save_file(out, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral"])
def test_fused_expert_checkpoints_load(name, moe_dir, prompts, tmp_path):
    """Both checkpoint layouts give the same model (and transformers reads the fused one too)."""
    path = moe_dir(name)
    fused = _fuse_experts(path, tmp_path / "fused")
    _, per_expert = _generate(path, prompts)
    _, outs = _generate(fused, prompts)
    for a, b in zip(per_expert, outs, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
    _check(hf_model(fused), prompts, outs)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_router_ties_choose_the_experts_transformers_chooses(family, prompts, tmp_path, default_model_dir):
    """Every router row equal: each token's probabilities tie across all experts, so which
    top-k experts run is ``torch.topk``'s tie order alone (the experts differ, so another
    choice changes the outputs)."""
    path = make_tiny_model(tmp_path / "m", default_model_dir, family, num_experts_per_tok=2)
    sd = load_file(path / "model.safetensors")
    for key in [k for k in sd if k.endswith(("mlp.gate.weight", "block_sparse_moe.gate.weight"))]:
        sd[key] = sd[key][:1].expand_as(sd[key]).contiguous()
    save_file(sd, path / "model.safetensors", metadata={"format": "pt"})
    _, outs = _generate(path, prompts)
    _check(hf_model(path), prompts, outs)


def test_prefix_cache_hits_on_moe(moe_dir, prompts):
    path = moe_dir("qwen3_moe-window")
    ref = hf_model(path)
    llm = LLM(str(path), dtype="float32", device="cpu", max_model_len=128, max_num_batched_tokens=24)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    first = llm.generate([{"prompt_token_ids": prompts[0][:40]}], params)
    longer = prompts[0][:40] + prompts[2] + prompts[3]
    hits = llm.llm_engine.kv.stats.hits
    second = llm.generate([{"prompt_token_ids": longer}], params)
    assert llm.llm_engine.kv.stats.hits >= hits + 2
    check_greedy(ref, prompts[0][:40], first[0].outputs[0].token_ids)
    check_greedy(ref, longer, second[0].outputs[0].token_ids)


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral"])
def test_attention_only_adapters_on_moe_bases_match_peft(name, moe_dir, prompts, tmp_path):
    """Attention-only LoRA of several ranks beside base rows."""
    base = moe_dir(name)
    specs = [(4, ["q_proj", "v_proj"]), (16, ["q_proj", "k_proj", "v_proj", "o_proj"]), (8, ["k_proj", "o_proj"])]
    adapters = [make_peft_adapter(base, tmp_path / f"a{i}", r=r, target_modules=t, seed=i, std=0.1)
                for i, (r, t) in enumerate(specs)]
    llm = LLM(str(base), dtype="float32", device="cpu", max_model_len=128, enable_lora=True,
              max_loras=len(adapters), max_lora_rank=16, max_num_batched_tokens=64)
    choice = [i % (len(adapters) + 1) for i in range(len(prompts) + 1)]
    choice = [None if c == len(adapters) else c for c in choice]
    rows = (prompts + prompts)[: len(choice)]
    loras = [None if c is None else LoRARequest(f"{name}-{c}", c + 1, str(adapters[c])) for c in choice]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
    outs = llm.generate([{"prompt_token_ids": p} for p in rows], params, lora_request=loras)
    moved = check_rows_match_peft(base, adapters, rows, choice, outs)
    assert len(moved) >= len(adapters) - 1


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral"])
def test_bfloat16_runs_close_to_float32(name, moe_dir, prompts):
    from support.greedy_reference import teacher_forced_logits

    path = moe_dir(name)
    llm = LLM(str(path), dtype="bfloat16", device="cpu", max_model_len=128)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=2))
    ref = hf_model(path)
    for prompt, out in zip(prompts, outs, strict=True):
        comp = out.outputs[0]
        assert all(math.isfinite(e[t].logprob) for t, e in zip(comp.token_ids, comp.logprobs, strict=True))
        probs = torch.softmax(teacher_forced_logits(ref, prompt, comp.token_ids[:1])[0], dim=-1)
        assert probs[comp.token_ids[0]] >= 0.5 * probs.max()
