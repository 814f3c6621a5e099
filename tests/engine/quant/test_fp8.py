"""FP8 weights in compressed-tensors checkpoints (written by the library: ``float-quantized``
with dynamic per-token activations declared, ``naive-quantized`` weight-only; per-tensor and
per-channel scales in float32 or bfloat16) of tiny random models of several families: the
engine's weights dequantize exactly to the published rule (itself checked against the
library's decompression), tokens and logprobs teacher-forced match transformers over the
library's decompression, and a PEFT LoRA / DoRA mix on top matches PEFT."""

from __future__ import annotations

import logging

import pytest
import torch
from awq_gptq_layouts import check_engine_weights
from fp8_checkpoints import library_decompressed, reference_fp8_weights, write_fp8
from safetensors.torch import load_file
from support.lora_fixtures import make_dora_adapter, make_peft_adapter
from support.peft_harness import check_rows_match_peft, peft_prompts
from support.tiny_models import make_tiny_model

from loramux.engine import LLM, LoRARequest, SamplingParams

CASES = {  # name: (family, strategy, format, scale dtype)
    "llama-channel-dynamic": ("llama", "channel", "float-quantized", torch.float32),
    "qwen2-tensor-naive": ("qwen2", "tensor", "naive-quantized", torch.float32),
    "phi3-tensor-dynamic": ("phi3", "tensor", "float-quantized", torch.float32),  # fused parts
    "gemma3-channel-bf16": ("gemma3", "channel", "float-quantized", torch.bfloat16),
}


def load(folder, **kw):
    return LLM(str(folder), dtype="float32", device="cpu", max_model_len=128,
               max_num_batched_tokens=48, **kw)


@pytest.mark.parametrize("name", list(CASES))
def test_fp8_matches_the_library(name, tmp_path, default_model_dir, caplog):
    family, strategy, fmt, dtype = CASES[name]
    src = make_tiny_model(tmp_path / "float", default_model_dir, family)
    folder = write_fp8(src, tmp_path / "fp8", strategy=strategy, fmt=fmt, dtype=dtype)
    ref_weights = reference_fp8_weights(folder)
    deq = library_decompressed(folder, tmp_path / "deq")
    lib = load_file(deq / "model.safetensors")
    for m, w in ref_weights.items():  # the published rule is the library's
        torch.testing.assert_close(lib[m + ".weight"], w, rtol=0, atol=0)
    with caplog.at_level(logging.INFO, logger="loramux.engine.model.quant"):
        llm = load(folder, quantization="compressed-tensors")
    declared = "kept in the model's dtype (no FP8 math on the CPU)" in caplog.text
    assert declared == (fmt == "float-quantized")
    model = llm.llm_engine.model
    assert check_engine_weights(model, ref_weights) == set(ref_weights)
    qkv = model.layers[0].qkv
    bias = qkv.bias.numel() * qkv.bias.element_size() if qkv.bias is not None else 0
    if "kernel_weight" in qkv.params:  # the CPU kernel's layout: rows padded to 32, fp32 scales
        weight, scale = qkv.params["kernel_weight"], qkv.params["kernel_scale"]
        assert weight.shape == (qkv.out_features, -(-qkv.in_features // 32) * 32)
    else:
        weight, scale = qkv.params["weight"], qkv.params["weight_scale"]
    assert weight.dtype == torch.float8_e4m3fn  # one byte a weight in memory
    assert qkv.nbytes - bias == qkv.out_features * (weight.shape[1] + scale.element_size())
    prompts = peft_prompts(default_model_dir, 60)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    moved = check_rows_match_peft(deq, [], prompts, [None] * len(prompts), outs)
    assert moved == []


def test_lora_over_fp8_matches_peft(tmp_path, default_model_dir):
    src = make_tiny_model(tmp_path / "float", default_model_dir, "llama")
    folder = write_fp8(src, tmp_path / "fp8", strategy="tensor")
    adapters = [make_peft_adapter(src, tmp_path / "a0", r=8, target_modules=["q_proj", "v_proj",
                                                                            "down_proj"], std=0.1),
                make_dora_adapter(src, tmp_path / "a1", r=4, target_modules=["q_proj", "o_proj"],
                                  seed=1, std=0.1)]
    llm = LLM(str(folder), dtype="float32", device="cpu", max_model_len=128, enable_lora=True,
              max_loras=2, max_lora_rank=8, max_num_batched_tokens=64)
    prompts = peft_prompts(default_model_dir, 40)
    choice = [[0, 1, None][i % 3] for i in range(len(prompts))]
    loras = [None if c is None else LoRARequest(f"fp8-{c}", c + 1, str(adapters[c])) for c in choice]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, lora_request=loras)
    base = library_decompressed(folder, tmp_path / "deq")
    assert set(check_rows_match_peft(base, adapters, prompts, choice, outs)) == {0, 1}
