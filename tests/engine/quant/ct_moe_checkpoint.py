"""A Qwen3-MoE checkpoint with every expert compressed-tensors int4 (per-expert tensors as
llm-compressor writes them: ``mlp.experts.<e>.<gate|up|down>_proj.weight_packed``), and its
reference twin holding the library's dequantized experts."""

from __future__ import annotations

import json
import re
import shutil

import torch
from safetensors.torch import load_file, save_file

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


def write_int4_experts(src, quant, ref):
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
