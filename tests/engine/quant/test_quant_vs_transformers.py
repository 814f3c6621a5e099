"""Quantized base models (compressed-tensors int4 / int8 weight-only, written by the library
itself from tiny random models of several families) teacher-forced against transformers'
dequantized load of the same checkpoint (asymmetric ones: transformers on the library's own
decompression of it): every token within the tie tolerance of the
reference's max logit and every returned logprob the reference's."""

from __future__ import annotations

import pytest
import torch
from support.greedy_reference import TIE_TOL
from support.lora_fixtures import teacher_forcing_gaps
from support.peft_harness import peft_prompts
from support.quant_checkpoints import dequantized_reference, library_dequantized, write_compressed
from support.tiny_models import make_tiny_model

from loramux.engine import LLM, SamplingParams
from loramux.engine.model.quant.base import QuantLinear

CASES = {  # name: (family, num_bits, group_size, model overrides[, symmetric])
    "llama-int4-g32": ("llama", 4, 32, {}),
    "llama-int8-channel": ("llama", 8, None, {}),
    "qwen2-int4-g64": ("qwen2", 4, 64, {}),  # q/k/v biases beside packed weights
    "phi3-int8-g32": ("phi3", 8, 32, {}),  # fused qkv_proj / gate_up_proj, its own lm_head
    "llama-int4-g128": ("llama", 4, 128, dict(hidden_size=128, intermediate_size=256)),
    "gemma3-int4-g64": ("gemma3", 4, 64, {}),  # sandwich norms, q/k norms, GELU, soft-caps
    "llama-int4-g32-asym": ("llama", 4, 32, {}, False),  # weight_zero_point
    "phi3-int8-channel-asym": ("phi3", 8, None, {}, False),  # zero points of fused rows
}


@pytest.mark.parametrize("name", list(CASES))
def test_quantized_base_matches_transformers(name, tmp_path, default_model_dir):
    family, bits, group, overrides, *asym = CASES[name]
    src = make_tiny_model(tmp_path / "float", default_model_dir, family, **overrides)
    folder = write_compressed(src, tmp_path / "quant", num_bits=bits, group_size=group,
                              symmetric=not asym)
    llm = LLM(str(folder), dtype="float32", device="cpu", max_model_len=128,
              max_num_batched_tokens=48)
    model = llm.llm_engine.model
    assert model.quant.name == "compressed-tensors"
    assert all(isinstance(lin, QuantLinear) for lin in (model.layers[0].qkv, model.layers[0].o,
                                                        *model.layers[0].mlp.linears))
    assert not isinstance(model.lm_head, QuantLinear)  # ignored, as the config says
    prompts = peft_prompts(default_model_dir, 60)  # one prompt runs in several chunks
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    # transformers 5.25 reinitialises packed zero points: asymmetric folders are decompressed
    # by the library first
    ref = library_dequantized(folder, tmp_path / "deq") if asym else dequantized_reference(folder)
    for prompt, out in zip(prompts, outs, strict=True):
        comp = out.outputs[0]
        gaps, ref_lp = teacher_forcing_gaps(ref, prompt, comp.token_ids)
        assert max(gaps) <= TIE_TOL, gaps
        for j, entry in enumerate(comp.logprobs):
            for tid, lp in entry.items():
                assert lp.logprob == pytest.approx(ref_lp[j, tid].item(), abs=1e-4, rel=1e-4)


def test_quantized_weights_count_their_stored_bytes(tmp_path, default_model_dir):
    """``weight_bytes`` counts packed integers and scales, not a dequantized copy."""
    src = make_tiny_model(tmp_path / "float", default_model_dir, "llama")
    float_bytes = LLM(str(src), dtype="float32", device="cpu").llm_engine.model.weight_bytes()
    folder = write_compressed(src, tmp_path / "quant", num_bits=4, group_size=32)
    model = LLM(str(folder), dtype="float32", device="cpu").llm_engine.model
    qkv = model.layers[0].qkv  # [q + 2 kv, H] = [128, 64]: int4 packs 8 to an int32
    assert qkv.nbytes == 128 * 64 // 2 + 128 * (64 // 32) * 4
    linear_float = sum(lin.nbytes for w in LLM(str(src), dtype="float32", device="cpu").llm_engine
                       .model.layers for lin in (w.qkv, w.o, *w.mlp.linears))
    linear_quant = sum(lin.nbytes for w in model.layers for lin in (w.qkv, w.o, *w.mlp.linears))
    assert linear_quant * 6 < linear_float  # 4 bits + a float32 scale per 32 weights
    assert float_bytes - model.weight_bytes() == linear_float - linear_quant
    stored = "kernel_weight" if "kernel_weight" in qkv.params else "weight_packed"  # kernel layout
    assert qkv.params[stored].dtype in (torch.uint8, torch.int32)  # repacked at load when it runs
