"""Triton kernel of DoRA's per-row scale: ``y[t] += y[t] ⊙ gain[rows[t]] (+ shift[rows[t]])``
for the tokens of a span, in place, one launch per projection (no gathered copy of the
gains). Tokens whose row is the zero row (not DoRA) are skipped. Computed in fp32, stored in
y's dtype. Imported only by the Triton backend (``engine/lora/dora.py``); guarded import as
``triton_ops``.
"""

from __future__ import annotations

import torch

from loramux.engine.model.triton_import import HAS_TRITON, tl, triton

__all__ = ["HAS_TRITON", "dora_scale_rows"]

_BLOCK_N = 256

if HAS_TRITON:

    @triton.jit
    def _dora_kernel(
        y_ptr,  # [T_span, N] (a row slice of y), updated in place
        gain_ptr,  # [num_rows, N]  g - 1
        shift_ptr,  # [num_rows, N]  (1 - g) * bias, or gain_ptr when HAS_SHIFT is false
        rows_ptr,  # [T_span] int64 row of each token
        N,
        ZERO_ROW,
        stride_yt,
        stride_g,
        stride_s,
        HAS_SHIFT: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        t = tl.program_id(0)
        row = tl.load(rows_ptr + t)
        if row == ZERO_ROW:
            return
        offs = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask = offs < N
        y = tl.load(y_ptr + t * stride_yt + offs, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(gain_ptr + row * stride_g + offs, mask=mask, other=0.0).to(tl.float32)
        out = y + y * g
        if HAS_SHIFT:
            out += tl.load(shift_ptr + row * stride_s + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(y_ptr + t * stride_yt + offs, out.to(y_ptr.dtype.element_ty), mask=mask)


def dora_scale_rows(y: torch.Tensor, gain: torch.Tensor, shift: torch.Tensor | None,
                    rows: torch.Tensor, zero_row: int) -> None:
    """``y[t] += y[t] * gain[rows[t]] + shift[rows[t]]`` for every t of ``y`` [T, N] (a span
    of the step's output, last dimension contiguous); rows equal to ``zero_row`` untouched."""
    if y.shape[0] == 0:
        return
    if y.stride(1) != 1 or gain.stride(1) != 1 or (shift is not None and shift.stride(1) != 1):
        raise ValueError("dora_scale_rows needs a contiguous last dimension")
    n = y.shape[1]
    grid = (y.shape[0], triton.cdiv(n, _BLOCK_N))
    other = shift if shift is not None else gain
    _dora_kernel[grid](
        y, gain, other, rows, n, zero_row, y.stride(0), gain.stride(0), other.stride(0),
        HAS_SHIFT=shift is not None, BLOCK_N=_BLOCK_N,
    )
