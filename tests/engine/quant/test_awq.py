"""AWQ (AutoAWQ's GEMM layout, 4-bit) checkpoints of tiny random models of several families:
the engine's repacked weights dequantize exactly to the format's reference dequantization,
and its tokens and logprobs, teacher-forced, are transformers' over those dequantized
weights in float32."""

from __future__ import annotations

import pytest
from awq_gptq_layouts import check_engine_weights, reference_weights, write_awq, write_dequantized
from support.greedy_reference import TIE_TOL
from support.lora_fixtures import teacher_forcing_gaps
from support.peft_harness import peft_prompts
from support.tiny_models import make_tiny_model

from loramux.engine import LLM, SamplingParams
from loramux.engine.model.quant.base import QuantLinear

CASES = {  # name: (family, group_size, zero_point, modules_to_not_convert, model overrides)
    "llama-g32": ("llama", 32, True, (), {}),
    "qwen2-g64": ("qwen2", 64, True, (), {}),  # q/k/v biases beside packed weights
    "phi3-g32": ("phi3", 32, True, (), {}),  # fused qkv_proj / gate_up_proj, its own lm_head
    "gemma3-channel": ("gemma3", -1, True, (), {}),  # group_size -1: one scale per row
    "llama-g32-no-zero-point": ("llama", 32, False, ("down_proj",), {}),  # uint4b8, one kept float
    "qwen3-moe-g32": ("qwen3_moe", 32, True, (), {}),  # per-expert qweight, router float
}


@pytest.mark.parametrize("name", list(CASES))
def test_awq_matches_reference_dequantization(name, tmp_path, default_model_dir):
    family, group, zp, skip, overrides = CASES[name]
    src = make_tiny_model(tmp_path / "float", default_model_dir, family, **overrides)
    folder = write_awq(src, tmp_path / "awq", group_size=group, zero_point=zp, skip=skip)
    llm = LLM(str(folder), dtype="float32", device="cpu", max_model_len=128,
              max_num_batched_tokens=48, quantization="awq")
    model = llm.llm_engine.model
    assert model.quant.name == "awq"
    assert not isinstance(model.lm_head, QuantLinear)
    ref_weights = reference_weights(folder)
    assert check_engine_weights(model, ref_weights) == set(ref_weights)
    assert any("down_proj" in m for m in ref_weights) == (not skip)
    qkv = model.layers[0].qkv
    assert qkv.params["kernel_weight"].element_size() * qkv.params["kernel_weight"].shape[1] * 2 \
        == qkv.in_features  # 4 bits a weight in memory, never a dequantized copy
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
