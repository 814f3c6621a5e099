"""FP8 weights in compressed-tensors checkpoints (``float-quantized`` / ``naive-quantized``
formats): ``weight`` stored as ``float8_e4m3fn`` [out, in] beside ``weight_scale``, float32 or
bfloat16, [1] per tensor or [out, 1] per channel; ``W = weight.to(scale dtype) * scale``, as
the library's ``dequantize`` computes it.

A config group may declare ``input_activations`` (FP8 W8A8: dynamic, per token or per
tensor): this CPU has no FP8 math, so the activations stay in the model's dtype and only the
weights are FP8 (the start-up log says so). Static activation scales (``input_scale``) and
every other float scheme (other widths, groups, blocks, zero points) are refused naming the
field. On the CPU the layer holds the compiled kernel's layout (``int_packed.fp8_kernel_layout``;
``loramux::wq_linear`` widens each byte exactly), except a float32 model of 16-bit scales
(the library rounds each weight to the scales' dtype; the kernel's float32 sums do not);
elsewhere the matmul dequantizes a band of output rows at a time
(:meth:`~loramux.engine.model.quant.base.WeightOnlyMethod.apply`). The weights stay one byte
each in memory.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from loramux.engine.errors import ModelLoadError
from loramux.engine.model.quant.base import Shape, Take

FLOAT_FORMATS = ("float-quantized", "naive-quantized")
"""compressed-tensors formats that hold FP8 weights unpacked."""
FP8 = torch.float8_e4m3fn


@dataclass(frozen=True)
class FloatScheme:
    """How one config group stores FP8 weights."""

    strategy: str
    """``tensor`` (one scale) or ``channel`` (one per output row)."""
    activations: str | None = None
    """The declared dynamic activation quantization (``token`` / ``tensor``), not applied on
    the CPU; None: none declared."""
    num_bits: int = 8
    group_size: None = None
    """Never grouped (per tensor or per channel): read as the integer schemes' field is."""

    def describe(self) -> str:
        acts = (f", input activations FP8 dynamic per {self.activations} declared: kept in the "
                "model's dtype (no FP8 math on the CPU)" if self.activations else "")
        return f"fp8 e4m3 weights per-{self.strategy}{acts}"


def parse_float_scheme(at: str, group: Mapping[str, Any],
                       refuse: Callable[[str, Any, str], ModelLoadError]) -> FloatScheme:
    """The scheme of config group ``at`` (its ``format`` one of :data:`FLOAT_FORMATS`), every
    field checked; ``refuse(field, value, why)`` builds the error."""
    if group.get("output_activations") is not None:
        raise refuse(f"{at}.output_activations", "...", "output activation quantization is "
                     "not supported")
    w = group.get("weights")
    if not isinstance(w, Mapping):
        raise refuse(f"{at}.weights", w, "a weight scheme is required")
    checks = (
        ("type", w.get("type") == "float", "supported: float (integer weights: pack-quantized)"),
        ("num_bits", w.get("num_bits") == 8, "supported: 8 (float8_e4m3fn)"),
        ("strategy", w.get("strategy") in ("tensor", "channel"), "supported: tensor, channel"),
        ("symmetric", w.get("symmetric", True) is True, "FP8 zero points are not supported"),
        ("dynamic", not w.get("dynamic", False), "dynamic weight scales are not supported"),
        ("actorder", w.get("actorder") is None, "not supported with FP8 weights"),
        ("block_structure", w.get("block_structure") is None, "block scales are not supported"),
    )
    for key, ok, why in checks:
        if not ok:
            raise refuse(f"{at}.weights.{key}", w.get(key), why)
    a = group.get("input_activations")
    if a is None:
        return FloatScheme(w["strategy"])
    if not isinstance(a, Mapping):
        raise refuse(f"{at}.input_activations", a, "a scheme or null is required")
    checks = (
        ("type", a.get("type") == "float" and a.get("num_bits") == 8, "supported: float 8-bit"),
        ("dynamic", a.get("dynamic") is True, "static activation scales are not supported "
         "(dynamic only; the CPU keeps activations in the model's dtype)"),
        ("strategy", a.get("strategy") in ("token", "tensor"), "supported: token, tensor"),
    )
    for key, ok, why in checks:
        if not ok:
            raise refuse(f"{at}.input_activations.{key}", a.get(key), why)
    return FloatScheme(w["strategy"], a["strategy"])


def read_fp8(module: str, scheme: FloatScheme, shape: Shape, take: Take,
             bad: Callable[[str, str], ModelLoadError]) -> dict[str, torch.Tensor]:
    """One module's ``weight`` (FP8 [out, in]) and ``weight_scale`` (as [out, 1], a
    per-tensor scale repeated per row so that fused parts concatenate), checked against
    each other, the scheme and the config's shape; ``bad(tensor, why)`` builds the error."""
    p = module + "."
    weight, scale = take(p + "weight"), take(p + "weight_scale")
    if weight.dtype != FP8 or weight.dim() != 2:
        raise bad(p + "weight", f"is {weight.dtype} {list(weight.shape)}; the scheme stores "
                  "float8_e4m3fn [out, in]")
    out, k = weight.shape
    if shape is not None and (out, k) != tuple(shape):
        raise bad(p + "weight", f"is {list(weight.shape)}; the model's config makes this "
                  f"weight {list(shape)}")
    want = (1,) if scheme.strategy == "tensor" else (out, 1)
    if not scale.is_floating_point() or scale.dtype == FP8 or scale.numel() != want[0] or (
            scheme.strategy == "channel" and tuple(scale.shape) != want):
        raise bad(p + "weight_scale", f"is {scale.dtype} {list(scale.shape)}; a per-"
                  f"{scheme.strategy} scale is a float {list(want)}")
    if not bool(torch.isfinite(scale).all()):
        raise bad(p + "weight_scale", "holds non-finite values")
    if take(p + "input_scale", None) is not None:
        raise bad(p + "input_scale", "is a static activation scale; the scheme declares none "
                  "(dynamic activations only)")
    return {"weight": weight, "weight_scale": scale.reshape(1, 1).expand(out, 1).contiguous()
            if scheme.strategy == "tensor" else scale}


def dequantize_fp8_rows(params: dict[str, torch.Tensor], start: int, stop: int) -> torch.Tensor:
    """Rows ``start:stop`` of an FP8 weight as the library dequantizes them: the FP8 values
    in the scale's dtype times the scale, [stop - start, in]."""
    scale = params["weight_scale"][start:stop]  # [r, 1]
    return params["weight"][start:stop].to(scale.dtype) * scale
