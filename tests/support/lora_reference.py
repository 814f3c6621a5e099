"""Slow, obviously correct LoRA shrink and expand (per segment, fp32): the reference the
torch and Triton backends are tested against. Not part of the product."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from loramux.engine.lora.meta import LoRABatchMeta


def reference_shrink(
    x: torch.Tensor, a_stack: torch.Tensor, meta: LoRABatchMeta, scale: torch.Tensor
) -> torch.Tensor:
    """Slow per-segment shrink in fp32."""
    num_slots, num_slices, R, K = a_stack.shape
    v = torch.zeros(num_slices, meta.num_lora_tokens, R, dtype=torch.float32, device=x.device)
    for start, n, slot in zip(
        meta.seg_starts.tolist(), meta.seg_lens.tolist(), meta.seg_slots.tolist(), strict=True
    ):
        rows = meta.sorted_token_idx[start : start + n]
        xs = x[rows].float()  # [n, K]
        for s in range(num_slices):
            v[s, start : start + n] = float(scale[slot]) * (xs @ a_stack[slot, s].float().T)
    return v


def reference_expand(
    v: torch.Tensor,
    b_stack: torch.Tensor,
    meta: LoRABatchMeta,
    y: torch.Tensor,
    slice_offsets: Sequence[int],
) -> None:
    """Slow per-segment expand, fp32 accumulation and one add per row."""
    offs = list(slice_offsets)
    for start, n, slot in zip(
        meta.seg_starts.tolist(), meta.seg_lens.tolist(), meta.seg_slots.tolist(), strict=True
    ):
        rows = meta.sorted_token_idx[start : start + n]
        for s in range(v.shape[0]):
            lo, hi = offs[s], offs[s + 1]
            delta = v[s, start : start + n].float() @ b_stack[slot, lo:hi].float().T  # [n, hi-lo]
            y[rows, lo:hi] = (y[rows, lo:hi].float() + delta).to(y.dtype)
