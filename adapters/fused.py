"""Adapters in another spelling of the base's projections, rewritten in the base's own.

The engine maps either spelling onto its slots (``engine/lora/slots.py``). PEFT only knows
the model's own modules, so an export (``merge.py``) first rewrites an adapter trained on
split names (``q_proj``, ``k_proj``, ``v_proj``) for a base whose checkpoints fuse them
(Phi-3's ``qkv_proj``) as the one LoRA on the fused module that computes the same delta:
rank ``k * r`` for ``k`` slices, A the slices' A stacked, B block-diagonal (each slice's B in
its rows and its own rank columns), the scale kept (``alpha_pattern``; ``rank_pattern`` for
the larger rank). Nothing is approximated: ``B' A' = Σ_s B_s A_s`` on the slices' rows.
A DoRA adapter's magnitudes are per output row, so the fused module's is the slices'
concatenated; a slice the adapter leaves out gets its base rows' norms (``row_norms``), which
makes its scale exactly 1 there.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

import torch

from loramux.adapters.arch import FUSED_MODULES, MODULE_PARENT, BaseModelDims, tensor_key
from loramux.adapters.archive import CONFIG_NAME, WEIGHTS_NAME
from loramux.adapters.format import LoraWeights


def needs_rewrite(weights: LoraWeights, dims: BaseModelDims) -> bool:
    """Whether ``weights`` targets modules the base's checkpoints do not have by that name."""
    native = dims.family.native_modules
    return any(m not in native for modules in weights.layers.values() for m in modules)


def write_native(
    weights: LoraWeights, dims: BaseModelDims, folder: str | Path,
    row_norms: Callable[[int, str], torch.Tensor] | None = None,
) -> Path:
    """Write ``weights`` as a PEFT adapter folder in the base family's own module names.
    ``row_norms(layer, module)``: the base weight's row norms [out] of a fused module (read
    for DoRA adapters that leave some of its slices out)."""
    from safetensors.torch import save_file

    native = dims.family.native_modules
    shapes = dims.module_shapes()
    spec = weights.spec
    r = spec.r
    tensors: dict[str, torch.Tensor] = {}
    rank_pattern: dict[str, int] = {}
    alpha_pattern: dict[str, float] = {}
    paths: set[str] = set()

    def put(layer: int, module: str, a: torch.Tensor, b: torch.Tensor, m: torch.Tensor | None) -> None:
        tensors[tensor_key(layer, module, "A", weights.prefix)] = a.contiguous()
        tensors[tensor_key(layer, module, "B", weights.prefix)] = b.contiguous()
        if m is not None:
            tensors[tensor_key(layer, module, "M", weights.prefix)] = m.contiguous()
        paths.add(f"{weights.prefix}layers.{layer}.{MODULE_PARENT[module]}.{module}")

    for layer, modules in sorted(weights.layers.items()):
        mags = weights.magnitudes.get(layer, {})
        for module, (a, b) in modules.items():
            if module in native:
                put(layer, module, a, b, mags.get(module))
        for fused, parts in FUSED_MODULES.items():
            if fused not in native or not any(p in modules for p in parts):
                continue
            k = len(parts)
            ref = next(modules[p][0] for p in parts if p in modules)
            stacked_a = ref.new_zeros(k * r, shapes[fused][0])  # [k r, K]
            stacked_b = ref.new_zeros(shapes[fused][1], k * r)  # [N_total, k r]
            row = 0
            for s, part in enumerate(parts):
                rows = shapes[part][1]
                if part in modules:
                    a, b = modules[part]
                    stacked_a[s * r : (s + 1) * r] = a
                    stacked_b[row : row + rows, s * r : (s + 1) * r] = b
                row += rows
            magnitude = None
            if spec.use_dora:
                missing = [p for p in parts if p not in mags]
                if missing and row_norms is None:
                    raise ValueError(
                        f"layer {layer}: a DoRA adapter on {[p for p in parts if p in mags]} but not "
                        f"{missing} needs the base's row norms to be written on "
                        f"{dims.family.title}'s fused {fused}")
                norms = row_norms(layer, fused) if missing else None
                pieces, row = [], 0
                for part in parts:
                    rows = shapes[part][1]
                    pieces.append(mags[part].float() if part in mags else norms[row : row + rows].float())
                    row += rows
                magnitude = torch.cat(pieces)
            put(layer, fused, stacked_a, stacked_b, magnitude)
            rank_pattern[fused] = k * r
            alpha_pattern[fused] = spec.lora_alpha * (math.sqrt(k) if spec.use_rslora else k)
    unknown = {m for ms in weights.layers.values() for m in ms} - set(native) - {
        p for f, parts in FUSED_MODULES.items() if f in native for p in parts
    }
    if unknown:
        raise ValueError(f"cannot rewrite {sorted(unknown)} in {dims.family.title}'s module names")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / WEIGHTS_NAME), metadata={"format": "pt"})
    config = spec.to_config(weights.prefix)
    config.update(target_modules=sorted(paths), layers_to_transform=None, rank_pattern=rank_pattern,
                  alpha_pattern=alpha_pattern)
    (folder / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")
    return folder
