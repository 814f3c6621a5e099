"""MoE experts of a quantized checkpoint (Qwen3-MoE, compressed-tensors int4 per-expert tensors as
llm-compressor writes them: ``mlp.experts.<e>.<gate|up|down>_proj.weight_packed``): each expert
is the quantization method's projection (the router and attention float), teacher-forced
against transformers running the same experts dequantized by the compressed-tensors library, a
plain LoRA on top against PEFT over that dequantized base, base rows beside it."""

from __future__ import annotations

import json
import re
import shutil

import torch
from safetensors.torch import load_file, save_file
from support.lora_fixtures import make_peft_adapter
from support.peft_harness import check_rows_match_peft, peft_prompts
from support.tiny_models import make_tiny_model

from loramux.engine import LLM, LoRARequest, SamplingParams

GROUP = 16


def _quantize(w: torch.Tensor):
    """compressed-tensors' int4 symmetric group quantization of w [out, in]: ``(packed int32,
    scale, the library's dequantized weight)``."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import dequantize, quantize
    from compressed_tensors.quantization.utils import calculate_qparams

    args = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=GROUP)
    grouped = w.float().unflatten(-1, (-1, GROUP))  # [out, G, g]
    scale, zp = calculate_qparams(grouped.amin(-1), grouped.amax(-1), args)  # [out, G]
    q = quantize(w.float(), scale, zp, args, dtype=torch.int8)
    return pack_to_int32(q, 4), scale, dequantize(q, scale, zp, args).to(w.dtype)


def _write(src, quant, ref):
    """``quant``: ``src`` with every expert int4 (per-expert tensors); ``ref``: ``src`` with the
    experts replaced by the library's dequantized values (what the quantized model computes)."""
    shutil.copytree(src, quant)
    shutil.copytree(src, ref)
    (st,) = src.glob("*.safetensors")
    sd = load_file(st)
    qsd, rsd = {}, dict(sd)
    expert = re.compile(r".*\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight$")
    assert any(expert.match(k) for k in sd), "the tiny model's checkpoint keeps per-expert tensors"
    for key, t in sd.items():
        if not expert.match(key):
            qsd[key] = t
            continue
        packed, scale, back = _quantize(t)
        q = key.removesuffix("weight")
        qsd[q + "weight_packed"], qsd[q + "weight_scale"] = packed, scale
        qsd[q + "weight_shape"] = torch.tensor(list(t.shape), dtype=torch.int32)
        rsd[key] = back
    save_file(qsd, str(quant / st.name), metadata={"format": "pt"})
    save_file(rsd, str(ref / st.name), metadata={"format": "pt"})
    cfg = json.loads((quant / "config.json").read_text())
    cfg["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "pack-quantized",
        "config_groups": {"group_0": {"targets": [r"re:.*mlp\.experts\..*"], "weights": {
            "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": GROUP}}},
        "ignore": []}
    (quant / "config.json").write_text(json.dumps(cfg))


def test_quantized_experts_match_the_dequantized_reference(tmp_path, default_model_dir):
    src = make_tiny_model(tmp_path / "float", default_model_dir, "qwen3_moe")
    _write(src, tmp_path / "quant", tmp_path / "ref")
    prompts = peft_prompts(default_model_dir, 8)[:3]
    adapter = make_peft_adapter(tmp_path / "ref", tmp_path / "a", r=4, target_modules=["q_proj", "o_proj"],
                                std=0.1)
    llm = LLM(str(tmp_path / "quant"), dtype="float32", device="cpu", max_model_len=128, enable_lora=True,
              max_loras=1, max_lora_rank=8)
    model = llm.llm_engine.model
    experts = model.layers[0].mlp
    assert type(experts.gate_up[0]).__name__ == "QuantLinear" and len(experts.gate_up) == 8
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts + prompts[:1]], params,
                        lora_request=[None, LoRARequest("a", 1, str(adapter)), None,
                                      LoRARequest("a", 1, str(adapter))])
    check_rows_match_peft(tmp_path / "ref", [adapter], prompts + prompts[:1], [None, 0, None, 0], outs,
                          against_base=False)
    # the experts take their packed bytes (int4 + a scale per 16), not float32's
    float_bytes = 8 * 3 * 32 * 64 * 4
    assert sum(x.nbytes for x in experts.gate_up + experts.down) < float_bytes / 4
