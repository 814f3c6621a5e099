"""The small ops of a decoder layer: residual add + RMSNorm, rotary embedding, SiLU-and-mul
(and GeGLU's tanh-GELU-and-mul).

Two implementations of one interface. :class:`EagerOps` runs them as separate torch ops
(what ``--enforce-eager`` selects, the path on CUDA, and the fallback where the compiled
kernels are missing). :class:`FusedOps` runs each as one call of a compiled CPU operator
(``torch.ops.loramux.*``, ``kernels/ops.py``): no temporaries, one call instead of five to
eight per op, and the norm and activation outputs written straight in the dtype the next
matmul runs in (fp32 holding bf16-rounded values for a bf16 model on a CPU without bf16
matmuls, which saves the widening copy before each matmul). Both round where the eager bf16
ops round, so greedy outputs agree.

The model families call these methods (stable names): ``add_rms_norm`` (``unit_offset`` for
Gemma's ``(1 + w)`` norms), ``rope_state`` / ``rope``, ``silu_mul``, ``gelu_tanh_mul``.

The PyTorch compiler is not used for this: on the CPU each call of a ``torch.compile``d
function costs ~90-100 µs of guard and wrapper overhead (torch 2.13), more than the eager
ops it would fuse at decode sizes (measured 0.15-0.7× eager per fused region); the kernels
need no compile at start-up or per shape.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from loramux.engine.model.kernels import loader
from loramux.engine.model.kernels import ops as kernels

logger = logging.getLogger(__name__)

KERNEL_DTYPES = (torch.float32, torch.bfloat16)
"""The dtypes the compiled kernels take (never fp16 on the CPU)."""


class EagerOps:
    """The small ops as separate torch ops."""

    name = "eager"

    def __init__(self, cos: torch.Tensor, sin: torch.Tensor, eps: float, act_dtype: torch.dtype) -> None:
        self.cos, self.sin, self.eps = cos, sin, eps  # rotary tables [P, D] in the model dtype
        self.act_dtype = act_dtype  # dtype of the norm / activation outputs (the matmul input)

    def rope_state(self, positions: torch.Tensor) -> object:
        """Per-step rotary state for :meth:`rope` (built once per step, used by every layer)."""
        return (self.cos.index_select(0, positions).unsqueeze(1),
                self.sin.index_select(0, positions).unsqueeze(1))

    def add_rms_norm(
        self, residual: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
        *, unit_offset: bool = False,
    ) -> torch.Tensor:
        """``residual += delta`` in place (when given), then RMSNorm(residual) * weight, or with
        ``unit_offset`` Gemma's RMSNorm(residual) * (1 + weight) computed in fp32."""
        if delta is not None:
            residual.add_(delta)
        return rms_norm(residual, weight, self.eps, unit_offset=unit_offset)

    def rope(self, qk: torch.Tensor, state: object) -> torch.Tensor:
        """Rotary embedding of ``qk`` [T, heads, D] (rotate-half layout); returns the result
        (a new tensor here; the fused path rotates in place and returns ``qk``)."""
        cos, sin = state
        half = qk.shape[-1] // 2
        rotated = torch.cat([-qk[..., half:], qk[..., :half]], dim=-1)
        return qk * cos + rotated * sin

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` for gate|up [T, 2I] → [T, I]."""
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def gelu_tanh_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``gelu(gate, approximate="tanh") * up`` (GeGLU) for gate|up [T, 2I] → [T, I]."""
        gate, up = gate_up.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up


class FusedOps(EagerOps):
    """The small ops as one compiled operator call each (CPU, fp32 or bf16)."""

    name = "fused"

    def rope_state(self, positions: torch.Tensor) -> object:
        return positions.to(torch.int64).contiguous()

    def add_rms_norm(self, residual, delta, weight, *, unit_offset=False):
        return kernels.add_rms_norm(residual, delta, weight, self.eps, out_dtype=self.act_dtype,
                                    unit_offset=unit_offset)

    def rope(self, qk, state):
        t, heads, d = qk.shape
        if qk.stride(2) != 1 or qk.stride(1) != d:
            return super().rope(qk, (self.cos[state].unsqueeze(1), self.sin[state].unsqueeze(1)))
        return kernels.rope(qk, state, self.cos, self.sin)

    def silu_mul(self, gate_up):
        return kernels.silu_mul(gate_up, out_dtype=self.act_dtype)

    def gelu_tanh_mul(self, gate_up):
        return kernels.gelu_tanh_mul(gate_up, out_dtype=self.act_dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, unit_offset: bool = False) -> torch.Tensor:
    """RMSNorm as Hugging Face computes it: Llama's (low precision: normalize in fp32, cast,
    scale), or with ``unit_offset`` Gemma's (normalize and scale by ``1 + w`` in fp32, cast)."""
    if unit_offset:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        return (xf * (1.0 + weight.float())).to(x.dtype)
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def select_small_ops(
    cos: torch.Tensor, sin: torch.Tensor, eps: float, matmul_dtype: torch.dtype, enforce_eager: bool
) -> EagerOps:
    """The fused ops on a CPU where the compiled kernels load (unless ``enforce_eager``), else
    eager. Called once when the model is built; logs the choice and why."""
    dtype, device = cos.dtype, cos.device
    ops: EagerOps
    why = ""
    if enforce_eager:
        ops, why = EagerOps(cos, sin, eps, dtype), " (enforce_eager)"
    elif device.type != "cpu" or dtype not in KERNEL_DTYPES:
        ops = EagerOps(cos, sin, eps, dtype)
    elif not loader.available():
        ops, why = EagerOps(cos, sin, eps, dtype), f" (CPU kernels {loader.status().state})"
    else:
        ops = FusedOps(cos, sin, eps, matmul_dtype)
    logger.info("layer small ops: %s%s", ops.name, why)
    return ops
