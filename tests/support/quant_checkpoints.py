"""Quantized checkpoints written by the compressed-tensors library itself (as llm-compressor
saves them), and transformers' own dequantized load of them: the references the quantized
engine is tested against."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch


def write_compressed(src: Path, out: Path, *, num_bits: int = 4, group_size: int | None = 32,
                     symmetric: bool = True, ignore: tuple[str, ...] = ("lm_head",),
                     targets: tuple[str, ...] = ("Linear",)) -> Path:
    """Quantize the float model folder ``src`` to ``out`` as compressed-tensors'
    ``pack-quantized`` (``num_bits`` integers, symmetric or with zero points, per ``group_size``
    input features or per channel when None), min-max scales, through the library's own
    ``apply_quantization_config`` → ``ModelCompressor.compress_model`` → ``save_pretrained``
    → ``update_config``; the tokenizer files come along."""
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

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    args = QuantizationArgs(num_bits=num_bits, type="int", symmetric=symmetric,
                            strategy="group" if group_size else "channel", group_size=group_size)
    scheme = QuantizationScheme(targets=list(targets), weights=args)
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": scheme},
                                                        ignore=list(ignore)))
    with torch.no_grad():
        for _, module in model.named_modules():
            if is_module_quantized(module):
                w = module.weight.float()
                w = w.unflatten(-1, (-1, group_size)) if group_size else w.unsqueeze(1)  # [out, G, g]
                scale, zp = calculate_qparams(w.amin(-1), w.amax(-1), args)
                module.weight_scale.copy_(scale.reshape(module.weight_scale.shape))
                if not symmetric:
                    module.weight_zero_point.copy_(zp.reshape(module.weight_zero_point.shape))
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format="pack-quantized")
    compressor.compress_model(model)
    model.save_pretrained(out)
    compressor.update_config(out)
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.name not in ("config.json", "model.safetensors.index.json"):
            shutil.copy(f, out / f.name)
    return out


def dequantized_reference(folder: Path, adapter: Path | None = None):
    """transformers' load of a compressed-tensors folder, dequantized on the CPU (the library
    decompresses on the first forward pass: one is run before PEFT wraps it), with the PEFT
    adapter on top when given."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        model(torch.tensor([[1, 2]]))
    for module in model.modules():
        assert not hasattr(module, "weight_packed"), "the reference did not dequantize"
    if adapter is None:
        return model
    from peft import PeftModel

    return PeftModel.from_pretrained(model, adapter).eval()


def edit_checkpoint(folder: Path, *, drop: tuple[str, ...] = (), replace: dict | None = None,
                    config: dict | None = None) -> None:
    """Corrupt a single-file checkpoint in place: drop tensors, replace some, update the
    ``quantization_config`` (a dict merged into it, nested one level)."""
    from safetensors.torch import load_file, save_file

    path = folder / "model.safetensors"
    tensors = {k: v for k, v in load_file(path).items() if k not in drop}
    tensors.update(replace or {})
    save_file(tensors, path, metadata={"format": "pt"})
    if config:
        cfg = json.loads((folder / "config.json").read_text())
        qc = cfg["quantization_config"]
        for key, value in config.items():
            if isinstance(value, dict) and isinstance(qc.get(key), dict):
                qc[key] = {**qc[key], **value}
            else:
                qc[key] = value
        (folder / "config.json").write_text(json.dumps(cfg))


def library_dequantized(folder: Path, out: Path, adapter: Path | None = None):
    """transformers on the float folder the compressed-tensors library decompresses ``folder``
    into (its ``PackedQuantizationCompressor.decompress`` per module; for what transformers'
    own load gets wrong: it reinitialises packed zero points), with the PEFT adapter on top."""
    from compressed_tensors.compressors.pack_quantized import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationConfig
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    if not (out / "model.safetensors").exists():
        cfg = json.loads((folder / "config.json").read_text())
        qc = QuantizationConfig.model_validate(cfg.pop("quantization_config"))
        scheme = next(iter(qc.config_groups.values()))
        tensors = load_file(folder / "model.safetensors")
        for name in [k for k in tensors if k.endswith(".weight_packed")]:
            module = name.removesuffix(".weight_packed")
            part = {k.removeprefix(module + "."): tensors.pop(k) for k in list(tensors)
                    if k.startswith(module + ".weight_")}
            tensors[module + ".weight"] = PackedQuantizationCompressor.decompress(part, scheme)["weight"]
        out.mkdir(parents=True, exist_ok=True)
        save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
        (out / "config.json").write_text(json.dumps(cfg))
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    if adapter is None:
        return model
    from peft import PeftModel

    return PeftModel.from_pretrained(model, adapter).eval()
