"""Layer pieces the families share beside the small ops (``small_ops.py``): RMSNorm with or
without Gemma's unit offset, per-head q/k norms, the gated MLP's activations.

Every norm goes through the small ops (the compiled CPU operators where they load, eager
torch otherwise): Llama's RMSNorm, or Gemma's ``(1 + w)`` one (``unit_offset``: computed in
float32 throughout and cast at the end, as transformers does). Per-head q/k norms of a
[T, heads, D] view run as the eager norm of the same definition.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from loramux.engine.model.small_ops import EagerOps, rms_norm


class Norms:
    """The RMSNorms of one model (``offset`` 1: Gemma's ``(1 + w)``)."""

    def __init__(self, ops: EagerOps, eps: float, offset: float) -> None:
        if offset not in (0.0, 1.0):
            raise ValueError(f"RMSNorm weight offset {offset}: only 0 and 1 (Gemma) exist")
        self.ops, self.eps, self.unit_offset = ops, eps, bool(offset)

    def add_norm(
        self, residual: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor
    ) -> torch.Tensor:
        """``residual += delta`` in place (when given), then the norm of ``residual`` [T, H]
        (in the dtype the next matmul runs in)."""
        return self.ops.add_rms_norm(residual, delta, weight, unit_offset=self.unit_offset)

    def sandwich(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """The norm of a sublayer's output [T, H] before it joins the residual, in ``x``'s dtype
        (Gemma's post-attention and post-feed-forward norms)."""
        if x.dim() == 2 and x.stride(1) == 1:
            return self.ops.add_rms_norm(x, None, weight, unit_offset=self.unit_offset).to(x.dtype)
        return self.norm(x, weight)

    def norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """The norm of ``x`` [..., D] over its last dimension, in ``x``'s dtype (q/k norms)."""
        return rms_norm(x, weight, self.eps, unit_offset=self.unit_offset)


ACTIVATIONS: dict[str, str] = {
    "silu": "silu_mul",
    "gelu_pytorch_tanh": "gelu_tanh_mul",
    "gelu_tanh": "gelu_tanh_mul",
}
"""Gated activations (``act(gate) * up`` of gate|up [T, 2I] → [T, I]) by config name → the
small op computing it."""


def gated_activation(name: str, ops: EagerOps) -> Callable[[torch.Tensor], torch.Tensor]:
    """The ``act(gate) * up`` function for a config's ``hidden_act`` / ``hidden_activation``."""
    try:
        return getattr(ops, ACTIVATIONS[name])
    except KeyError:
        raise ValueError(
            f"activation {name!r} is not supported; supported: {', '.join(ACTIVATIONS)}"
        ) from None
