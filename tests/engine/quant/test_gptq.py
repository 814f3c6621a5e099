"""GPTQ checkpoints (v1 and v2 zero points, 4 and 8 bits, grouped and per channel, with and
without ``desc_act``) of tiny random models of several families: the engine's repacked
weights dequantize exactly to the format's reference dequantization (``g_idx`` read as
the format reads it), and its tokens and logprobs, teacher-forced, are transformers' over
those dequantized weights in float32."""

from __future__ import annotations

import pytest
from awq_gptq_layouts import check_engine_weights, reference_weights, write_dequantized, write_gptq
from support.greedy_reference import TIE_TOL
from support.lora_fixtures import teacher_forcing_gaps
from support.peft_harness import peft_prompts
from support.tiny_models import make_tiny_model

from loramux.engine import LLM, SamplingParams
from loramux.engine.model.quant.base import QuantLinear

CASES = {  # name: (family, bits, group_size, write_gptq options)
    "llama-int4-g32": ("llama", 4, 32, {}),
    "llama-int4-g32-desc-act": ("llama", 4, 32, dict(desc_act=True)),  # a permutation per module
    "qwen2-int4-g32-desc-act-shared": ("qwen2", 4, 32, dict(desc_act=True, shared_perm=True)),
    "phi3-int8-channel-asym": ("phi3", 8, -1, dict(sym=False)),  # fused qkv_proj / gate_up_proj
    "gemma3-int4-g32-asym-v2": ("gemma3", 4, 32, dict(sym=False, fmt="gptq_v2", desc_act=True)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_gptq_matches_reference_dequantization(name, tmp_path, default_model_dir):
    check_gptq(CASES[name], tmp_path, default_model_dir)


def check_gptq(case, tmp_path, default_model_dir) -> None:
    """Write ``case`` (family, bits, group_size, ``write_gptq`` options) from a tiny random
    model, load it, and check its weights and teacher-forced outputs against the references."""
    family, bits, group, opts = case
    src = make_tiny_model(tmp_path / "float", default_model_dir, family)
    folder = write_gptq(src, tmp_path / "gptq", bits=bits, group_size=group, **opts)
    llm = LLM(str(folder), dtype="float32", device="cpu", max_model_len=128,
              max_num_batched_tokens=48, quantization="gptq")
    model = llm.llm_engine.model
    assert model.quant.name == "gptq"
    assert isinstance(model.lm_head, QuantLinear) == opts.get("lm_head", False)
    ref_weights = reference_weights(folder)
    assert check_engine_weights(model, ref_weights) == set(ref_weights)
    qkv = model.layers[0].qkv
    assert qkv.params["kernel_weight"].numel() * 8 == qkv.out_features * qkv.in_features * bits
    if opts.get("desc_act"):  # one permutation per distinct order among q, k, v
        assert qkv.params["perm"].shape[0] == (1 if opts.get("shared_perm") or family == "phi3" else 3)
    assert ("kernel_zero" in qkv.params) == (not opts.get("sym", True))
    prompts = peft_prompts(default_model_dir, 60)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(write_dequantized(folder, tmp_path / "deq")).eval()
    for prompt, out in zip(prompts, outs, strict=True):
        comp = out.outputs[0]
        gaps, ref_lp = teacher_forcing_gaps(ref, prompt, comp.token_ids)
        assert max(gaps) <= TIE_TOL, gaps
        for j, entry in enumerate(comp.logprobs):
            for tid, lp in entry.items():
                assert lp.logprob == pytest.approx(ref_lp[j, tid].item(), abs=1e-4, rel=1e-4)
