"""Random adapters for tests and benchmarks (never used on the request path)."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from loramux.adapters.arch import base_dims
from loramux.adapters.format import LoraWeights, save_adapter
from loramux.adapters.spec import LoraSpec


def random_lora(
    base_config: Any,
    *,
    r: int = 8,
    lora_alpha: float = 16.0,
    target_modules: Sequence[str] = ("q_proj", "v_proj"),
    layers: Sequence[int] | None = None,
    use_rslora: bool = False,
    seed: int = 0,
    std: float = 0.05,
    dtype: torch.dtype = torch.float32,
    base_model_name_or_path: str | None = None,
) -> LoraWeights:
    """A LoRA with random A and B (B non-zero, unlike PEFT's initialization)."""
    dims = base_dims(base_config)
    gen = torch.Generator().manual_seed(seed)
    spec = LoraSpec(
        r=r,
        lora_alpha=float(lora_alpha),
        target_modules=tuple(target_modules),
        use_rslora=use_rslora,
        base_model_name_or_path=base_model_name_or_path,
        layers_to_transform=tuple(layers) if layers is not None else None,
    )
    out: dict[int, dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}
    for layer in layers if layers is not None else range(dims.num_layers):
        for module in target_modules:
            in_f, out_f = dims.module_shape(module)
            a = (torch.randn(r, in_f, generator=gen) * std).to(dtype)
            b = (torch.randn(out_f, r, generator=gen) * std).to(dtype)
            out.setdefault(layer, {})[module] = (a, b)
    return LoraWeights(spec, out)


def write_random_adapter(base: Any, path: str | os.PathLike, **kwargs: Any) -> Path:
    """Write :func:`random_lora` as a PEFT adapter folder at ``path``; ``base`` is a base
    model folder or its config (a dict or a ``PretrainedConfig``). The one adapter maker
    of the tests and benchmarks (PEFT-trained references: ``lora_fixtures``)."""
    if isinstance(base, str | os.PathLike):
        base = json.loads((Path(base) / "config.json").read_text())
    return save_adapter(random_lora(base, **kwargs), path)
