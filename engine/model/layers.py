"""Layer pieces the families share beside the small ops (``small_ops.py``): RMSNorm with a
weight offset, per-head q/k norms, the gated MLP's activations.

Llama-style RMSNorm (offset 0) goes through the small ops (the fused CPU kernel where it
loads). Gemma's ``(1 + w)`` RMSNorm (offset 1) is computed as transformers does it — in
float32 throughout, ``(x * rsqrt(mean(x²) + eps)) * (1 + w)`` cast back at the end: through
the small ops' ``unit_offset`` norm where they have one (the compiled kernels'), else here,
with ``1 + w`` kept in float32 (in bfloat16 it would lose ``w``'s low bits). GeGLU likewise
uses the small ops' ``gelu_tanh_mul`` where they have it.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch
import torch.nn.functional as F

from loramux.engine.model.small_ops import EagerOps, rms_norm


class Norms:
    """RMSNorms of one model: ``weight`` tensors are prepared once by :meth:`prepare`."""

    def __init__(self, ops: EagerOps, eps: float, offset: float) -> None:
        self.ops, self.eps, self.offset = ops, eps, offset
        if offset not in (0.0, 1.0):
            raise ValueError(f"RMSNorm weight offset {offset}: only 0 and 1 (Gemma) exist")
        # the small ops' Gemma norm (``unit_offset``), where they have one
        self.unit_offset_ops = bool(offset) and "unit_offset" in inspect.signature(ops.add_rms_norm).parameters

    def prepare(self, weight: torch.Tensor) -> torch.Tensor:
        """The weight as the norm reads it (offset ones here: ``1 + w`` in float32)."""
        if self.offset and not self.unit_offset_ops:
            return weight.float() + self.offset
        return weight

    def add_norm(
        self, residual: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor
    ) -> torch.Tensor:
        """``residual += delta`` in place (when given), then the norm of ``residual``."""
        if not self.offset:
            return self.ops.add_rms_norm(residual, delta, weight)
        if self.unit_offset_ops:
            return self.ops.add_rms_norm(residual, delta, weight, unit_offset=True)
        if delta is not None:
            residual.add_(delta)
        return self.norm(residual, weight)

    def norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """The norm of ``x`` [..., D] over its last dimension, in ``x``'s dtype."""
        if not self.offset:
            return rms_norm(x, weight, self.eps)
        if self.unit_offset_ops:
            return rms_norm(x, weight, self.eps, unit_offset=True)
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * weight).to(x.dtype)


def _silu_mul(ops: EagerOps) -> Callable[[torch.Tensor], torch.Tensor]:
    return ops.silu_mul


def _gelu_tanh_mul(ops: EagerOps) -> Callable[[torch.Tensor], torch.Tensor]:
    fused = getattr(ops, "gelu_tanh_mul", None)
    if fused is not None:
        return fused

    def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up

    return gelu_tanh_mul


ACTIVATIONS: dict[str, Callable[[EagerOps], Callable[[torch.Tensor], torch.Tensor]]] = {
    "silu": _silu_mul,
    "gelu_pytorch_tanh": _gelu_tanh_mul,
    "gelu_tanh": _gelu_tanh_mul,
}
"""Gated activations (``act(gate) * up`` of gate|up [T, 2I] → [T, I]) by config name."""


def gated_activation(name: str, ops: EagerOps) -> Callable[[torch.Tensor], torch.Tensor]:
    """The ``act(gate) * up`` function for a config's ``hidden_act`` / ``hidden_activation``."""
    try:
        return ACTIVATIONS[name](ops)
    except KeyError:
        raise ValueError(
            f"activation {name!r} is not supported; supported: {', '.join(ACTIVATIONS)}"
        ) from None
