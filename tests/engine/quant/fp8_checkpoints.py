"""FP8 compressed-tensors checkpoints written by the library itself (as llm-compressor saves
them: ``float-quantized`` with dynamic per-token FP8 activations declared, or
``naive-quantized`` weight-only), the library's own decompression of them into a float folder
(the reference transformers and PEFT load), and an independent dequantization
(``weight.to(scale dtype) * scale``, the published rule) to compare the engine's weights with."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


def write_fp8(src: Path, out: Path, *, strategy: str = "channel", fmt: str = "float-quantized",
              dtype: torch.dtype = torch.float32, ignore: tuple[str, ...] = ("lm_head",)) -> Path:
    """Quantize the float folder ``src`` to FP8 e4m3 weights (``strategy``: ``tensor`` or
    ``channel`` scales, min-max) in ``fmt`` through the library's ``apply_quantization_config``
    → ``ModelCompressor.compress_model`` → ``save_pretrained`` → ``update_config``. With
    ``float-quantized`` the scheme declares dynamic per-token FP8 input activations (W8A8
    FP8, as llm-compressor's ``FP8_DYNAMIC`` preset). ``dtype``: the model's, and so the
    scales' (float32 or bfloat16)."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        apply_quantization_config,
    )
    from compressed_tensors.quantization.utils import calculate_qparams
    from compressed_tensors.quantization.utils.helpers import is_module_quantized
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, dtype=dtype)
    args = QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy=strategy)
    acts = QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy="token", dynamic=True)
    scheme = QuantizationScheme(targets=["Linear"], weights=args,
                                input_activations=acts if fmt == "float-quantized" else None)
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": scheme},
                                                        ignore=list(ignore)))
    with torch.no_grad():
        for _, module in model.named_modules():
            if is_module_quantized(module):
                w = module.weight.float()
                lo, hi = ((w.amin().reshape(1), w.amax().reshape(1)) if strategy == "tensor"
                          else (w.amin(1, keepdim=True), w.amax(1, keepdim=True)))
                scale, _ = calculate_qparams(lo, hi, args)
                module.weight_scale.copy_(scale.reshape(module.weight_scale.shape))
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=fmt)
    compressor.compress_model(model)
    model.save_pretrained(out)
    compressor.update_config(out)
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.name not in ("config.json", "model.safetensors.index.json"):
            shutil.copy(f, out / f.name)
    return out


def reference_fp8_weights(folder: Path) -> dict[str, torch.Tensor]:
    """Every FP8 module's weight [out, in] float32 by the published rule: the e4m3 value in
    the scale's dtype times the scale (per tensor: one; per channel: [out, 1])."""
    t = load_file(folder / "model.safetensors")
    out = {}
    for name in [k for k in t if k.endswith(".weight") and t[k].dtype == torch.float8_e4m3fn]:
        m = name[:-len(".weight")]
        s = t[m + ".weight_scale"]
        out[m] = (t[name].to(s.dtype) * s.reshape(-1, 1)).float()
    return out


def library_decompressed(folder: Path, out: Path) -> Path:
    """A float32 folder of ``folder``'s weights decompressed by the library's own
    ``NaiveQuantizationCompressor.decompress`` per module (the reference)."""
    from compressed_tensors.compressors.naive_quantized import NaiveQuantizationCompressor
    from compressed_tensors.quantization import QuantizationConfig

    if (out / "model.safetensors").exists():
        return out
    cfg = json.loads((folder / "config.json").read_text())
    qc = QuantizationConfig.model_validate(cfg.pop("quantization_config"))
    scheme = next(iter(qc.config_groups.values()))
    tensors = load_file(folder / "model.safetensors")
    for name in [k for k in tensors if k.endswith(".weight_scale")]:
        module = name.removesuffix(".weight_scale")
        part = {k.removeprefix(module + "."): tensors.pop(k) for k in list(tensors)
                if k.startswith(module + ".weight")}
        tensors[module + ".weight"] = NaiveQuantizationCompressor.decompress(part, scheme)["weight"]
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.float() for k, v in tensors.items()}, out / "model.safetensors",
              metadata={"format": "pt"})
    cfg["dtype"] = "float32"
    (out / "config.json").write_text(json.dumps(cfg))
    for f in folder.iterdir():
        if f.suffix != ".safetensors" and f.name != "config.json":
            shutil.copy(f, out / f.name)
    return out
