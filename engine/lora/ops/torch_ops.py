"""Pure-torch LoRA shrink/expand: the CPU default and the reference for the Triton kernels.

The fast path runs a constant number of torch ops per layer, whatever the number of
adapters: one gather of x rows into the padded chunk layout of ``LoRABatchMeta``, one
gather of the chunks' A matrices (a view when the chunks use consecutive slots), one ``bmm``
for all slices, then per slice (<= 3) one ``bmm`` with the chunks' B rows into one delta
buffer, and one ``index_add_`` of the delta rows into y. With a single chunk the GEMMs are
plain ``mm``; decode-sized steps run the expand in fp32 (16-bit GEMMs have a large fixed
cost on CPU, and v is fp32 already).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from loramux.engine.lora.meta import LoRABatchMeta
from loramux.engine.lora.ops import cpu_sgmv

__all__ = ["add_lora", "lora_expand", "lora_shrink"]

# Expand in fp32 when the step has at most this many padded rows (decode-sized batches).
_FP32_EXPAND_MAX_ROWS = 64
# Up to this many runs of consecutive same-adapter tokens, the blockdiag path runs two
# GEMMs per run on views of x, y and the slot's weights (no gathers, no padding); past
# it, the padded chunk layout's constant number of ops wins. Equal runs leading the batch
# in consecutive slots (uniform decodes) take two batched GEMMs instead.
_MAX_RUNS = 8


def _check_offsets(slice_offsets: Sequence[int], num_slices: int, n_total: int) -> list[int]:
    offs = [int(o) for o in slice_offsets]
    if len(offs) != num_slices + 1 or offs[0] != 0 or offs[-1] != n_total:
        raise ValueError(
            f"slice_offsets must be {num_slices + 1} ints from 0 to {n_total}; got {offs}"
        )
    if any(b < a for a, b in zip(offs, offs[1:], strict=False)):
        raise ValueError(f"slice_offsets must be non-decreasing; got {offs}")
    return offs


def _chunk_weights(stack: torch.Tensor, meta: LoRABatchMeta, dtype: torch.dtype) -> torch.Tensor:
    """``stack[chunk_slots]`` in ``dtype``: a view when the chunks use consecutive slots."""
    if meta.chunk_slot_start is not None:
        w = stack.narrow(0, meta.chunk_slot_start, meta.num_chunks)
    else:
        w = stack.index_select(0, meta.chunk_slots)
    return w.to(dtype)


def _shrink_padded(
    x: torch.Tensor, a_stack: torch.Tensor, meta: LoRABatchMeta, scale: torch.Tensor
) -> torch.Tensor:
    """Shrink in the chunk layout -> ``[NC * C, num_slices, R]`` fp32 (pad rows arbitrary)."""
    _, num_slices, R, K = a_stack.shape
    if x.shape != (meta.num_tokens, K):
        raise ValueError(f"x must be [{meta.num_tokens}, {K}]; got {list(x.shape)}")
    NC, C = meta.num_chunks, meta.chunk_len
    cdtype = torch.promote_types(x.dtype, a_stack.dtype)
    if meta.identity_tokens:  # the LoRA tokens are rows 0..T_lora-1 already in slot order
        xg = x.narrow(0, 0, meta.num_lora_tokens)
    else:
        xg = x.index_select(0, meta.chunk_tokens)  # [NC*C, K]
    xg = xg.to(cdtype)
    a = _chunk_weights(a_stack, meta, cdtype).reshape(NC, num_slices * R, K)
    if NC == 1:  # mm has less fixed cost than a batch-1 bmm
        out = torch.mm(xg, a[0].t()).view(1, C, num_slices * R)
    else:
        out = torch.bmm(xg.reshape(NC, C, K), a.transpose(1, 2))  # [NC, C, slices*R]
    if meta.chunk_slot_start is not None:
        sc = scale.narrow(0, meta.chunk_slot_start, NC)
    else:
        sc = scale.index_select(0, meta.chunk_slots)
    out = out * sc.to(torch.float32).view(NC, 1, 1)  # fp32
    return out.view(NC * C, num_slices, R)


def _expand_dtype(meta: LoRABatchMeta, y: torch.Tensor, b_stack: torch.Tensor) -> torch.dtype:
    """fp32 for few rows (a 16-bit GEMM's fixed cost dominates there; v is fp32 already),
    else the weights' / output's dtype."""
    if meta.num_chunks * meta.chunk_len <= _FP32_EXPAND_MAX_ROWS:
        return torch.float32
    return torch.promote_types(y.dtype, b_stack.dtype)


def _expand_padded(
    vp: torch.Tensor, b_stack: torch.Tensor, meta: LoRABatchMeta, y: torch.Tensor, offs: list[int]
) -> None:
    """Expand from the chunk layout ``vp`` ``[NC * C, num_slices, R]`` (pad rows zero) into y."""
    n_total = b_stack.shape[1]
    if y.shape != (meta.num_tokens, n_total):
        raise ValueError(f"y must be [{meta.num_tokens}, {n_total}]; got {list(y.shape)}")
    NC, C = meta.num_chunks, meta.chunk_len
    R = vp.shape[2]
    cdtype = _expand_dtype(meta, y, b_stack)
    vp = vp.to(cdtype)
    b = _chunk_weights(b_stack, meta, cdtype)  # [NC, N_total, R]
    delta = torch.empty(NC * C, n_total, dtype=cdtype, device=y.device)
    for s in range(len(offs) - 1):
        lo, hi = offs[s], offs[s + 1]
        if hi == lo:
            continue
        if NC == 1:
            torch.mm(vp[:, s], b[0, lo:hi].t(), out=delta[:, lo:hi])  # [C, n]
        else:
            vs = vp[:, s].reshape(NC, C, R)
            torch.bmm(vs, b[:, lo:hi].transpose(1, 2), out=delta.view(NC, C, n_total)[:, :, lo:hi])
    if meta.identity_tokens:
        y.narrow(0, 0, meta.num_lora_tokens).add_(delta)
    else:
        y.index_add_(0, meta.chunk_tokens, delta.to(y.dtype))  # pad rows add exact zeros


def _mask_pads(vp: torch.Tensor, meta: LoRABatchMeta) -> torch.Tensor:
    if meta.chunk_mask is None:
        return vp
    return vp * meta.chunk_mask.view(-1, 1, 1)


def lora_shrink(
    x: torch.Tensor, a_stack: torch.Tensor, meta: LoRABatchMeta, scale: torch.Tensor
) -> torch.Tensor:
    """Torch shrink: ``[T, K] -> [num_slices, T_lora, R]`` fp32 (see ``ops.lora_shrink``)."""
    _, num_slices, R, _ = a_stack.shape
    if not meta.has_lora:
        return torch.zeros(
            num_slices, meta.num_lora_tokens, R, dtype=torch.float32, device=x.device
        )
    out = _shrink_padded(x, a_stack, meta, scale)  # [NC*C, slices, R]
    if meta.chunk_keep is not None:
        out = out.index_select(0, meta.chunk_keep)  # [T_act, slices, R]
    if meta.active_pos is None:
        return out.permute(1, 0, 2)  # [slices, T_lora, R]
    v = torch.zeros(num_slices, meta.num_lora_tokens, R, dtype=torch.float32, device=x.device)
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
    offs = _check_offsets(slice_offsets, v.shape[0], b_stack.shape[1])
    if not meta.has_lora:
        return
    vp = v.permute(1, 0, 2)  # [T_lora, slices, R]
    if not meta.identity_layout:
        vp = _mask_pads(vp.index_select(0, meta.chunk_pos), meta)  # [NC*C, slices, R]
    _expand_padded(vp, b_stack, meta, y, offs)


def add_lora(
    y: torch.Tensor,
    x: torch.Tensor,
    a_stack: torch.Tensor,
    b_stack: torch.Tensor,
    meta: LoRABatchMeta,
    scale: torch.Tensor,
    slice_offsets: Sequence[int],
) -> None:
    """Fused shrink + expand that keeps v in the chunk layout (no sorted-order round trip)."""
    offs = _check_offsets(slice_offsets, a_stack.shape[1], b_stack.shape[1])
    if not meta.has_lora:
        return
    vp = _mask_pads(_shrink_padded(x, a_stack, meta, scale), meta)
    _expand_padded(vp, b_stack, meta, y, offs)


def add_lora_blockdiag(
    y: torch.Tensor,
    x: torch.Tensor,
    a_stack: torch.Tensor,
    b_blockdiag: torch.Tensor,
    meta: LoRABatchMeta,
    scale: torch.Tensor | None,
    slice_offsets: Sequence[int] | None = None,
) -> None:
    """Fused shrink + expand with every slice's expand in one GEMM.

    ``b_blockdiag``: ``[num_slots, num_slices * R, N_total]``, slice ``s``'s ``B.T`` in rows
    ``s*R:(s+1)*R`` and its own columns, zeros elsewhere (see ``SlotBuffers``). The zero
    blocks cost FLOPs the size of a rank-R GEMM, far less than the fixed cost of one more
    small GEMM per slice on the CPU. ``scale`` None: ``a_stack`` is already scaled.
    When the LoRA tokens lead the batch in slot order, the expand accumulates straight
    into ``y`` (``baddbmm_``), so a decode step costs two GEMMs per projection group.
    """
    if not meta.has_lora:
        return
    _, num_slices, R, K = a_stack.shape
    n_total = b_blockdiag.shape[2]
    if y.shape != (meta.num_tokens, n_total):
        raise ValueError(f"y must be [{meta.num_tokens}, {n_total}]; got {list(y.shape)}")
    NC, C = meta.num_chunks, meta.chunk_len
    if (scale is None and meta.runs and slice_offsets is not None
            and cpu_sgmv.usable(x, a_stack, b_blockdiag, y)):
        short, long, ranks = cpu_sgmv.split_runs(meta, a_stack.dtype)  # short runs: one kernel call
        cpu_sgmv.add_runs_sgmv(y, x, a_stack, b_blockdiag, short, meta.slot_ranks, slice_offsets)
        if long:
            _add_runs_ranked(y, x, a_stack, b_blockdiag, long, ranks, slice_offsets)
        return
    if scale is None and meta.identity_tokens and meta.chunk_slot_start is not None:
        _add_in_place(y, x, a_stack, b_blockdiag, meta, num_slices * R)  # 2 batched GEMMs
        return
    if scale is None and 0 < len(meta.runs) <= _MAX_RUNS:
        _add_runs(y, x, a_stack, b_blockdiag, meta.runs, num_slices * R)
        return
    if scale is None:
        scale = torch.ones(a_stack.shape[0], dtype=torch.float32, device=x.device)
    vp = _mask_pads(_shrink_padded(x, a_stack, meta, scale), meta)  # [NC*C, slices, R] fp32
    cdtype = _expand_dtype(meta, y, b_blockdiag)
    v = vp.reshape(NC, C, num_slices * R).to(cdtype)
    b = _chunk_weights(b_blockdiag, meta, cdtype)  # [NC, slices*R, N_total]
    if NC == 1:
        delta = torch.mm(v[0], b[0])  # [C, N_total]
    else:
        delta = torch.bmm(v, b).view(NC * C, n_total)
    if meta.identity_tokens:
        y.narrow(0, 0, meta.num_lora_tokens).add_(delta)
    else:
        y.index_add_(0, meta.chunk_tokens, delta.to(y.dtype))  # pad rows add exact zeros


def _add_in_place(y, x, a_stack, b_blockdiag, meta: LoRABatchMeta, sr: int) -> None:
    """Pre-scaled A, LoRA tokens at rows 0..T_lora-1 in consecutive slots: two batched
    GEMMs in the slots' dtype, the second accumulating into y when the dtypes agree."""
    NC, C = meta.num_chunks, meta.chunk_len
    K = x.shape[1]
    start = meta.chunk_slot_start
    a = a_stack.narrow(0, start, NC).reshape(NC, sr, K)  # [NC, S*R, K]
    b = b_blockdiag.narrow(0, start, NC)  # [NC, S*R, N]
    xs = x.narrow(0, 0, meta.num_lora_tokens).view(NC, C, K)
    v = torch.bmm(xs.to(a.dtype), a.transpose(1, 2))  # [NC, C, S*R]
    ys = y.narrow(0, 0, meta.num_lora_tokens).view(NC, C, -1)
    if ys.dtype == b.dtype:
        ys.baddbmm_(v, b)
    else:  # GEMMs in the slots' dtype (fp32 slots for a bf16 model on AVX2): never cast B
        ys.add_(torch.bmm(v, b))


def _add_runs(y, x, a_stack, b_blockdiag, runs, sr: int) -> None:
    """Pre-scaled A, few runs: per run of tokens of one slot, ``y[run] += (x[run] @ A.T) @ B``
    on views (the slot's weights are read in place, once per run); GEMMs in the slots'
    dtype, accumulated into y in y's dtype."""
    K = x.shape[1]
    for start, end, slot in runs:
        a = a_stack[slot].view(sr, K)  # [S*R, K]
        b = b_blockdiag[slot]  # [S*R, N]
        xs = x[start:end]
        v = torch.mm(xs if xs.dtype == a.dtype else xs.to(a.dtype), a.t())  # [n, S*R]
        ys = y[start:end]
        if ys.dtype == b.dtype:
            ys.addmm_(v, b)
        else:
            ys.add_(torch.mm(v, b))


def _add_runs_ranked(y, x, a_stack, b_blockdiag, runs, ranks: list[int], slice_offsets) -> None:
    """``_add_runs`` on each adapter's rank only: the shrink is one GEMM over the slices' rank
    rows, the expand one GEMM per slice into that slice's columns of y (views of the slot's
    B), so neither the slot's rank padding nor the zero blocks of the block-diagonal B are
    computed (for qkv with rank-16 adapters in rank-32 slots, 1/6 of the padded FLOPs)."""
    num_slices, max_rank, k = a_stack.shape[1:]
    offs = [int(o) for o in slice_offsets]
    for start, end, slot in runs:
        r = ranks[slot]
        xs = x[start:end]
        if xs.dtype != a_stack.dtype:
            xs = xs.to(a_stack.dtype)
        a = a_stack[slot, :, :r].reshape(num_slices * r, k)  # a copy only when r < max_rank
        v = torch.mm(xs, a.t())  # [n, S * r]
        for s in range(num_slices):
            lo, hi = offs[s], offs[s + 1]
            if hi == lo:
                continue
            b = b_blockdiag[slot, s * max_rank : s * max_rank + r, lo:hi]  # [r, cols] view
            ys = y[start:end, lo:hi]
            vs = v[:, s * r : (s + 1) * r]
            if ys.dtype == b.dtype:
                ys.addmm_(vs, b)
            else:
                ys.add_(torch.mm(vs, b))
