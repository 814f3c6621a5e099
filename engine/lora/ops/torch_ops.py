"""Pure-torch LoRA shrink/expand: the CPU default and the reference for the Triton kernels.

The fast path runs a constant number of torch ops per layer, whatever the number of
adapters: one gather of x rows into the padded chunk layout of ``LoRABatchMeta``, one
gather of the chunks' A matrices, one ``bmm`` for all slices, then per slice (<= 3) one
``bmm`` with the chunks' B rows and one ``index_add_`` into y.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from loramux.engine.lora.meta import LoRABatchMeta

__all__ = ["lora_expand", "lora_shrink"]


def _check_offsets(slice_offsets: Sequence[int], num_slices: int, n_total: int) -> list[int]:
    offs = [int(o) for o in slice_offsets]
    if len(offs) != num_slices + 1 or offs[0] != 0 or offs[-1] != n_total:
        raise ValueError(
            f"slice_offsets must be {num_slices + 1} ints from 0 to {n_total}; got {offs}"
        )
    if any(b < a for a, b in zip(offs, offs[1:], strict=False)):
        raise ValueError(f"slice_offsets must be non-decreasing; got {offs}")
    return offs


def lora_shrink(
    x: torch.Tensor, a_stack: torch.Tensor, meta: LoRABatchMeta, scale: torch.Tensor
) -> torch.Tensor:
    """Torch shrink: ``[T, K] -> [num_slices, T_lora, R]`` fp32 (see ``ops.lora_shrink``)."""
    num_slots, num_slices, R, K = a_stack.shape
    if x.shape != (meta.num_tokens, K):
        raise ValueError(f"x must be [{meta.num_tokens}, {K}]; got {list(x.shape)}")
    T_lora = meta.num_lora_tokens
    if not meta.has_lora:
        return torch.zeros(num_slices, T_lora, R, dtype=torch.float32, device=x.device)
    NC, C = meta.num_chunks, meta.chunk_len
    cdtype = torch.promote_types(x.dtype, a_stack.dtype)
    xg = x if meta.identity_tokens else x.index_select(0, meta.chunk_tokens)  # [NC*C, K]
    xg = xg.to(cdtype).reshape(NC, C, K)
    a = a_stack.index_select(0, meta.chunk_slots).to(cdtype)  # [NC, slices, R, K]
    out = torch.bmm(xg, a.view(NC, num_slices * R, K).transpose(1, 2))  # [NC, C, slices*R]
    out = out * scale.to(torch.float32).index_select(0, meta.chunk_slots).view(NC, 1, 1)
    out = out.view(NC * C, num_slices, R)  # fp32
    if meta.chunk_keep is not None:
        out = out.index_select(0, meta.chunk_keep)  # [T_act, slices, R]
    if meta.active_pos is None:
        return out.permute(1, 0, 2)  # [slices, T_lora, R]
    v = torch.zeros(num_slices, T_lora, R, dtype=torch.float32, device=x.device)
    v.index_copy_(1, meta.active_pos, out.permute(1, 0, 2))
    return v


def lora_expand(
    v: torch.Tensor,
    b_stack: torch.Tensor,
    meta: LoRABatchMeta,
    y: torch.Tensor,
    slice_offsets: Sequence[int],
) -> None:
    """Torch expand: ``y[tok, slice cols] += B[slot, slice rows] @ v[s, i]`` in place."""
    num_slices, T_lora, R = v.shape
    offs = _check_offsets(slice_offsets, num_slices, b_stack.shape[1])
    if y.shape != (meta.num_tokens, b_stack.shape[1]):
        raise ValueError(f"y must be [{meta.num_tokens}, {b_stack.shape[1]}]; got {list(y.shape)}")
    if not meta.has_lora:
        return
    NC, C = meta.num_chunks, meta.chunk_len
    cdtype = torch.promote_types(y.dtype, b_stack.dtype)
    if not meta.identity_layout:
        v = v.index_select(1, meta.chunk_pos)  # [slices, NC*C, R]
        if meta.chunk_mask is not None:
            v = v * meta.chunk_mask
    v = v.to(cdtype)
    b = b_stack.index_select(0, meta.chunk_slots).to(cdtype)  # [NC, N_total, R]
    for s in range(num_slices):
        lo, hi = offs[s], offs[s + 1]
        if hi == lo:
            continue
        out = torch.bmm(v[s].reshape(NC, C, R), b[:, lo:hi].transpose(1, 2))  # [NC, C, n]
        out = out.view(NC * C, hi - lo).to(y.dtype)
        ys = y if (lo == 0 and hi == y.shape[1]) else y[:, lo:hi]
        if meta.identity_tokens:
            ys.add_(out)
        else:
            ys.index_add_(0, meta.chunk_tokens, out)  # pad rows add exact zeros


def _reference_shrink(
    x: torch.Tensor, a_stack: torch.Tensor, meta: LoRABatchMeta, scale: torch.Tensor
) -> torch.Tensor:
    """Slow per-segment shrink in fp32; tests only."""
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


def _reference_expand(
    v: torch.Tensor,
    b_stack: torch.Tensor,
    meta: LoRABatchMeta,
    y: torch.Tensor,
    slice_offsets: Sequence[int],
) -> None:
    """Slow per-segment expand, fp32 accumulation and one add per row; tests only."""
    offs = _check_offsets(slice_offsets, v.shape[0], b_stack.shape[1])
    for start, n, slot in zip(
        meta.seg_starts.tolist(), meta.seg_lens.tolist(), meta.seg_slots.tolist(), strict=True
    ):
        rows = meta.sorted_token_idx[start : start + n]
        for s in range(v.shape[0]):
            lo, hi = offs[s], offs[s + 1]
            delta = v[s, start : start + n].float() @ b_stack[slot, lo:hi].float().T  # [n, hi-lo]
            y[rows, lo:hi] = (y[rows, lo:hi].float() + delta).to(y.dtype)
