"""DoRA adapters in the one batched path, teacher-forced against PEFT (float32, CPU): DoRA,
plain LoRA and base rows in one mixed batch (ranks 4..32, magnitudes moved away from the
base's norms, rsLoRA, partial targets), chunked prefill and prefix-cache hits, on the
Llama family (Qwen2's q/k/v biases too), Qwen3, Gemma 3, Gemma 2 and Phi-3 (DoRA on its fused
projections) and Qwen3-MoE (DoRA on attention beside the experts), through the torch, C and
Triton paths; the same A/B served as a plain LoRA gives other numbers (so the magnitude path
is what matches PEFT); bfloat16, the real default model (e2e), a cancelling adapter refused
at load, and speculative decoding's verify chunks through DoRA rows."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from support.lora_fixtures import ALL_MODULES, make_dora_adapter, make_peft_adapter, peft_reference
from support.peft_harness import check_rows_match_peft, peft_prompts
from support.tiny_models import make_tiny_llama, make_tiny_model

from loramux.engine import LLM, LoRARequest, SamplingParams

MAX_TOKENS = 6
# per family: [(kind, rank, targets, rslora, extra LoraConfig)]
ADAPTERS = [
    ("dora", 4, ["q_proj", "v_proj"], False, {}),
    ("dora", 16, ALL_MODULES, True, {}),
    ("lora", 8, ["q_proj", "k_proj", "down_proj"], False, {}),
    ("dora", 32, ["k_proj", "o_proj", "gate_proj"], False, {"layers_to_transform": [1]}),
]
MOE_ADAPTERS = [  # an MoE layer has no dense MLP: DoRA on attention
    ("dora", 4, ["q_proj", "v_proj"], False, {}),
    ("dora", 16, ["q_proj", "k_proj", "v_proj", "o_proj"], True, {}),
    ("lora", 8, ["q_proj", "k_proj"], False, {}),
    ("dora", 32, ["k_proj", "o_proj"], False, {"layers_to_transform": [1]}),
]
PHI3_ADAPTERS = [  # its checkpoints' fused names (PEFT knows no q_proj there)
    ("dora", 4, ["qkv_proj"], False, {}),
    ("dora", 16, ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"], True, {}),
    ("lora", 8, ["qkv_proj", "down_proj"], False, {}),
    ("dora", 32, ["o_proj", "gate_up_proj"], False, {"layers_to_transform": [1]}),
]


def _base(name, tmp_path, default_model_dir):
    if name == "llama":
        return make_tiny_llama(tmp_path / name, default_model_dir)
    if name == "qwen2":  # q/k/v biases: DoRA scales the projection, not its bias
        return make_tiny_llama(tmp_path / name, default_model_dir, architecture="qwen2")
    return make_tiny_model(tmp_path / name, default_model_dir, name)


def _adapters(base, tmp_path, specs=ADAPTERS):
    out = []
    for i, (kind, r, targets, rs, extra) in enumerate(specs):
        make = make_dora_adapter if kind == "dora" else make_peft_adapter
        out.append(make(base, tmp_path / f"a{i}", r=r, target_modules=targets, use_rslora=rs,
                        seed=i, std=0.1, **extra))
    return out


@pytest.fixture(scope="module")
def prompts(default_model_dir):
    return peft_prompts(default_model_dir, 60)  # longer than a step's budget: chunked prefill


def _check(outs, prompts, choice, adapters, base, refs, logprob_tol: float = 1e-4):
    check_rows_match_peft(base, adapters, prompts, choice, outs, refs=refs, against_base=False,
                          logprob_tol=logprob_tol)


CASES = {  # name: (family, slice_runs (None: the default), LoRA backend)
    "llama": ("llama", None, "torch"),
    "llama-span": ("llama", 0, "torch"),  # every step gathers a per-token scale over a span
    "llama-slices": ("llama", 100, "torch"),  # every step scales run by run
    "llama-triton": ("llama", None, "triton"),  # the Triton kernels (interpreted without a GPU)
    "qwen3": ("qwen3", None, "torch"),
    "qwen2": ("qwen2", None, "torch"),
    "gemma3": ("gemma3", None, "torch"),
    "gemma2": ("gemma2", None, "torch"),
    "phi3": ("phi3", None, "torch"),  # fused q|k|v and gate|up: each slice scaled by its rows' g
    "qwen3_moe": ("qwen3_moe", None, "torch"),  # DoRA on attention beside the experts
}


@pytest.mark.parametrize("case", list(CASES))
def test_dora_lora_and_base_rows_in_one_batch_match_peft(case, tmp_path, default_model_dir, prompts,
                                                         monkeypatch):
    name, slice_runs, backend = CASES[case]
    if slice_runs is not None:
        monkeypatch.setattr("loramux.engine.lora.dora.SLICE_RUNS", slice_runs)
    base = _base(name, tmp_path, default_model_dir)
    specs = {"phi3": PHI3_ADAPTERS, "qwen3_moe": MOE_ADAPTERS}.get(name, ADAPTERS)
    adapters = _adapters(base, tmp_path, specs)
    llm = LLM(str(base), dtype="float32", device="cpu", max_model_len=128, enable_lora=True,
              max_loras=len(adapters), max_lora_rank=32, max_num_batched_tokens=40,
              enable_prefix_caching=True, lora_backend=backend)
    choice = [0, 1, 2, 3, None, 1]
    loras = [None if c is None else LoRARequest(f"{name}-{c}", c + 1, str(adapters[c])) for c in choice]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)
    refs: dict = {}
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, lora_request=loras)
    _check(outs, prompts, choice, adapters, base, refs)
    # the same prompts again, other adapters on some rows: prefix-cache hits where they match
    hits = llm.llm_engine.stats().prefix_cache_hits
    choice2 = [3, 1, 0, 2, None, 1]  # row 1 (the long prompt) keeps its adapter: cache hits
    loras2 = [None if c is None else LoRARequest(f"{name}-{c}", c + 1, str(adapters[c])) for c in choice2]
    outs2 = llm.generate([{"prompt_token_ids": p} for p in prompts], params, lora_request=loras2)
    assert llm.llm_engine.stats().prefix_cache_hits > hits
    _check(outs2, prompts, choice2, adapters, base, refs)


def _as_plain_lora(src, dest):
    """The same A and B as a plain LoRA adapter (no magnitudes, use_dora off)."""
    shutil.copytree(src, dest)
    config = json.loads((dest / "adapter_config.json").read_text())
    config["use_dora"] = False
    (dest / "adapter_config.json").write_text(json.dumps(config))
    tensors = load_file(dest / "adapter_model.safetensors")
    save_file({k: v for k, v in tensors.items() if "magnitude" not in k}, dest / "adapter_model.safetensors")
    return dest


def test_same_a_b_as_plain_lora_gives_other_numbers(tmp_path, default_model_dir, prompts):
    base = make_tiny_llama(tmp_path / "llama", default_model_dir)
    dora = make_dora_adapter(base, tmp_path / "dora", r=8, target_modules=ALL_MODULES, std=0.1)
    plain = _as_plain_lora(dora, tmp_path / "plain")
    llm = LLM(str(base), dtype="float32", device="cpu", max_model_len=128, enable_lora=True,
              max_loras=2, max_lora_rank=8)
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    prompt = {"prompt_token_ids": prompts[0]}
    out_d, out_p = llm.generate([prompt, prompt], params, lora_request=[
        LoRARequest("dora", 1, str(dora)), LoRARequest("plain", 2, str(plain))])
    got_d = torch.tensor([next(iter(e.values())).logprob for e in out_d.prompt_logprobs[1:]])
    got_p = torch.tensor([next(iter(e.values())).logprob for e in out_p.prompt_logprobs[1:]])
    ids = torch.tensor(prompts[0])
    for adapter, got in ((dora, got_d), (plain, got_p)):
        with torch.no_grad():
            logits = peft_reference(base, adapter)(ids[None]).logits[0].float()
        want = torch.log_softmax(logits, -1)[:-1].gather(1, ids[1:, None]).squeeze(1)
        assert torch.allclose(got, want, atol=1e-4, rtol=1e-4)
    assert (got_d - got_p).abs().max() > 1e-2


def test_bfloat16_dora_rows_follow_peft(tmp_path, default_model_dir, prompts):
    """In bfloat16 (the scales kept as ``g - 1`` in bf16) a DoRA row's prompt logprobs stay
    near PEFT's float32 DoRA, much nearer than the same A/B served as plain LoRA are."""
    base = make_tiny_llama(tmp_path / "llama", default_model_dir)
    dora = make_dora_adapter(base, tmp_path / "dora", r=8, target_modules=ALL_MODULES, std=0.1)
    plain = _as_plain_lora(dora, tmp_path / "plain")
    llm = LLM(str(base), dtype="bfloat16", device="cpu", max_model_len=128, enable_lora=True,
              max_loras=1, max_lora_rank=8)
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    ids = torch.tensor(prompts[1])
    (out,) = llm.generate([{"prompt_token_ids": prompts[1]}], params,
                          lora_request=LoRARequest("dora", 1, str(dora)))
    got = torch.tensor([next(iter(e.values())).logprob for e in out.prompt_logprobs[1:]])
    err = {}
    for name, adapter in (("dora", dora), ("plain", plain)):
        with torch.no_grad():
            logits = peft_reference(base, adapter)(ids[None]).logits[0].float()
        want = torch.log_softmax(logits, -1)[:-1].gather(1, ids[1:, None]).squeeze(1)
        err[name] = float((got - want).abs().mean())
    assert err["dora"] < err["plain"] / 5, err


@pytest.mark.e2e
def test_default_model_dora_matches_peft(tmp_path, default_model_dir):
    """The real default model (SmolLM2-135M): an rsLoRA DoRA adapter on every projection,
    beside a base row, teacher-forced against PEFT in float32."""
    adapter = make_dora_adapter(default_model_dir, tmp_path / "a", r=16, target_modules="all-linear",
                                std=0.02, use_rslora=True)
    llm = LLM(str(default_model_dir), dtype="float32", device="cpu", max_model_len=256,
              enable_lora=True, max_loras=2, max_lora_rank=16)
    ids = [1, 504, 3458, 282, 260, 2387, 30, 422, 1811, 253]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1)
    dora, base = llm.generate([{"prompt_token_ids": ids}] * 2, params,
                              lora_request=[LoRARequest("a", 1, str(adapter)), None])
    assert dora.outputs[0].token_ids != base.outputs[0].token_ids
    # 30 layers of DoRA on every projection: fp32 sums in another order (AVX2's 8-wide lanes
    # against PEFT's) drift logprobs by ~1e-4 at the 6th token; the tokens themselves match
    _check([dora], [ids], [0], [adapter], default_model_dir, {}, logprob_tol=3e-4)


def test_dora_whose_rows_cancel_the_base_is_refused_at_load(tmp_path, default_model_dir):
    """``s·BA`` cancelling a base row makes ``‖W0 + s·BA‖`` ~0 and ``g`` huge: the load fails
    naming the module, and the engine keeps serving other requests."""
    base = make_tiny_llama(tmp_path / "llama", default_model_dir)
    adapter = make_dora_adapter(base, tmp_path / "dora", r=4, target_modules=["q_proj"], std=0.1)
    w0 = load_file(base / "model.safetensors")["model.layers.0.self_attn.q_proj.weight"]
    path = adapter / "adapter_model.safetensors"
    tensors = load_file(path)
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_"
    scale = 8 / 4  # lora_alpha 2r over r
    tensors[key + "A.weight"][0] = w0[0]
    tensors[key + "B.weight"][0] = 0.0
    tensors[key + "B.weight"][0, 0] = -1.0 / scale  # s·(BA)[0] = -W0[0]
    tensors[key + "magnitude_vector"][0] = 100.0  # accepted at upload (below 1e4)
    save_file(tensors, path)
    llm = LLM(str(base), dtype="float32", device="cpu", max_model_len=64, enable_lora=True,
              max_loras=1, max_lora_rank=4)
    params = SamplingParams(temperature=0, max_tokens=2)
    with pytest.raises(Exception, match=r"layer 0 q_proj scales its rows by up to .*nearly cancel"):
        llm.generate([{"prompt_token_ids": [1, 2, 3]}], params,
                     lora_request=LoRARequest("bad", 1, str(adapter)))
    (out,) = llm.generate([{"prompt_token_ids": [1, 2, 3]}], params)
    assert len(out.outputs[0].token_ids) == 2


def test_speculative_decoding_through_dora_rows_changes_nothing(tmp_path, default_model_dir):
    """ngram drafts verified as chunks through the same DoRA path: outputs equal plain decoding."""
    base = make_tiny_llama(tmp_path / "llama", default_model_dir)
    adapter = make_dora_adapter(base, tmp_path / "dora", r=8, target_modules=ALL_MODULES, std=0.2)
    prompt = "SELECT name FROM users WHERE id = 1; SELECT name FROM users WHERE id = 2; SELECT"
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    lora = LoRARequest("dora", 1, str(adapter))
    outs = []
    for spec in (None, {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3,
                        "prompt_lookup_min": 1}):
        llm = LLM(str(base), dtype="float32", max_model_len=256, block_size=4, enable_lora=True,
                  max_loras=1, speculative_config=spec)
        outs.append([o.outputs[0].token_ids for o in llm.generate([prompt, prompt], params,
                                                                   lora_request=[lora, None])])
    assert outs[0] == outs[1] and outs[0][0] != outs[0][1]
    assert sum(c.num_accepted_tokens for c in llm.llm_engine.stats().spec_decode.values()) > 0
