"""The small ops of a decoder layer: residual add + RMSNorm, rotary embedding, SiLU-and-mul.

Two implementations of one interface. :class:`EagerOps` runs them as separate torch ops
(what ``--enforce-eager`` selects, and the path on CUDA). :class:`FusedOps` runs each as one
pass of a C kernel (``csrc/fused_ops.c``, built like the attention kernel) on the CPU: no
temporaries, one call instead of five to eight per op, and the norm and activation outputs
written straight in the dtype the next matmul runs in (fp32 holding bf16-rounded values for
a bf16 model on a CPU without bf16 matmuls, which saves the widening copy before each
matmul). Both round where the eager bf16 ops round, so greedy outputs agree.

The PyTorch compiler is not used for this: on the CPU each call of a ``torch.compile``d
function costs ~90-100 µs of guard and wrapper overhead (torch 2.13), more than the eager
ops it would fuse at decode sizes (measured 0.15-0.7× eager per fused region); the kernels
need no compile at start-up or per shape.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from loramux.engine.model.cpu_kernels import DTYPE_CODES, fused_op

logger = logging.getLogger(__name__)


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
        self, residual: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor
    ) -> torch.Tensor:
        """``residual += delta`` in place (when given), then RMSNorm(residual) * weight."""
        if delta is not None:
            residual.add_(delta)
        return rms_norm(residual, weight, self.eps)

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


class FusedOps(EagerOps):
    """The small ops as one C kernel call each (CPU, fp32 or bf16)."""

    name = "fused"

    def __init__(self, cos, sin, eps, act_dtype) -> None:
        super().__init__(cos, sin, eps, act_dtype)
        self.dtype = DTYPE_CODES[cos.dtype]
        self.act = DTYPE_CODES[act_dtype]
        self._norm = fused_op("loramux_add_rms_norm")
        self._rope = fused_op("loramux_rope")
        self._silu = fused_op("loramux_silu_mul")

    def rope_state(self, positions: torch.Tensor) -> object:
        return positions.to(torch.int64).contiguous()

    def add_rms_norm(self, residual, delta, weight):
        t, h = residual.shape
        _check_rows(residual)
        out = torch.empty(t, h, dtype=self.act_dtype)
        if delta is not None:
            _check_rows(delta)
            dptr, dstride, dcode = delta.data_ptr(), delta.stride(0), DTYPE_CODES[delta.dtype]
        else:
            dptr, dstride, dcode = None, 0, 0
        self._norm(residual.data_ptr(), residual.stride(0), dptr, dstride, dcode, weight.data_ptr(),
                   out.data_ptr(), self.act, t, h, self.eps, self.dtype, torch.get_num_threads())
        return out

    def rope(self, qk, state):
        t, heads, d = qk.shape
        if qk.stride(2) != 1 or qk.stride(1) != d:
            return super().rope(qk, (self.cos[state].unsqueeze(1), self.sin[state].unsqueeze(1)))
        self._rope(qk.data_ptr(), qk.stride(0), state.data_ptr(), self.cos.data_ptr(),
                   self.sin.data_ptr(), t, heads, d, self.dtype, torch.get_num_threads())
        return qk

    def silu_mul(self, gate_up):
        t, two_i = gate_up.shape
        _check_rows(gate_up)
        out = torch.empty(t, two_i // 2, dtype=self.act_dtype)
        self._silu(gate_up.data_ptr(), gate_up.stride(0), out.data_ptr(), self.act, t, two_i // 2,
                   self.dtype, torch.get_num_threads())
        return out


def _check_rows(x: torch.Tensor) -> None:
    if x.dim() != 2 or x.stride(1) != 1 or x.dtype not in DTYPE_CODES or x.device.type != "cpu":
        raise ValueError(f"fused ops need dense CPU fp32/bf16 rows; got {x.dtype} {tuple(x.stride())}")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as Hugging Face computes it (low precision: normalize in fp32, cast, scale)."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def select_small_ops(
    cos: torch.Tensor, sin: torch.Tensor, eps: float, matmul_dtype: torch.dtype, enforce_eager: bool
) -> EagerOps:
    """The fused ops on a CPU where the kernel loads (unless ``enforce_eager``), else eager."""
    dtype, device = cos.dtype, cos.device
    ops: EagerOps
    if enforce_eager or device.type != "cpu" or dtype not in DTYPE_CODES:
        ops = EagerOps(cos, sin, eps, dtype)
    elif not all(fused_op(s) for s in ("loramux_add_rms_norm", "loramux_rope", "loramux_silu_mul")):
        ops = EagerOps(cos, sin, eps, dtype)  # the loader logged why
    else:
        ops = FusedOps(cos, sin, eps, matmul_dtype)
    logger.info("layer small ops: %s%s", ops.name, " (enforce_eager)" if enforce_eager else "")
    return ops
