"""Triton LoRA shrink/expand kernels (segmented gather-GEMM, punica/SGMV style).

Tokens are read through ``meta.sorted_token_idx``; one program handles one tile of one
segment (one adapter) and one slice, so each adapter's A/B tile is read once per tile.

* shrink: grid ``(SPLIT_K * M_tiles * N_tiles, num_slices, S)``, fp32 output ``v``;
  split-K programs ``atomic_add`` into ``v`` (``deterministic=True`` -> ``SPLIT_K = 1``).
* expand: grid ``(M_tiles * N_tiles, num_slices, S)``, no split-K (K = rank is small);
  every program reads its y tile once, adds the fp32 product, writes it once.
* decode path: when ``meta.max_seg_len <= DECODE_MAX_SEG_LEN`` tiles have 1-4 rows and the
  product is a broadcast multiply + ``tl.sum`` instead of a 16-row ``tl.dot``.

The triton import is guarded (``HAS_TRITON``), and ``loramux.engine.lora.ops`` imports this
module only when the Triton backend is asked for, so the package imports without triton.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from loramux.engine.lora.meta import LoRABatchMeta
from loramux.engine.model.triton_import import HAS_TRITON, tl, triton

__all__ = ["DECODE_MAX_SEG_LEN", "HAS_TRITON", "lora_expand", "lora_shrink"]

DECODE_MAX_SEG_LEN = 4
_MAX_SLICES = 3
_DECODE_TILE_ELEMS = 4096  # BLOCK_M * BLOCK_K * BLOCK_N of the broadcast product


def _next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _clamp(v: int, lo: int, hi: int) -> int:
    return max(lo, min(hi, v))


@functools.lru_cache(maxsize=16)
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # interpreter: small, so tests still exercise split-K


def _block_m(max_seg_len: int) -> tuple[int, bool]:
    """(BLOCK_M, USE_DOT) for the longest segment of the step."""
    if max_seg_len <= DECODE_MAX_SEG_LEN:
        return _next_pow2(max_seg_len), False
    return (16 if max_seg_len <= 16 else 32 if max_seg_len <= 32 else 64), True


def _precision(dtype: torch.dtype) -> str | None:
    """fp32 operands: exact fp32 products (no TF32), to match the torch reference."""
    return "ieee" if dtype == torch.float32 else None


if HAS_TRITON:

    @triton.jit
    def _shrink_kernel(
        x_ptr,  # [T, K]
        a_ptr,  # [num_slots, num_slices, R, K]
        v_ptr,  # [num_slices, T_lora, R] fp32, zero-initialised
        tok_ptr,  # [T_lora] int64 sorted_token_idx
        seg_start_ptr,  # [S]
        seg_len_ptr,  # [S]
        seg_slot_ptr,  # [S]
        rank_ptr,  # [num_slots]
        scale_ptr,  # [num_slots] fp32
        K,
        stride_xt, stride_xk,  # x
        stride_a0, stride_a1, stride_a2, stride_a3,  # A
        stride_v0, stride_v1, stride_v2,  # v
        NUM_N_TILES,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        SPLIT_K: tl.constexpr,
        USE_DOT: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
    ):
        pid = tl.program_id(0)
        slice_id = tl.program_id(1)
        seg = tl.program_id(2)
        pid_sk = pid % SPLIT_K
        pid_m = (pid // SPLIT_K) // NUM_N_TILES
        pid_n = (pid // SPLIT_K) % NUM_N_TILES

        slot = tl.load(seg_slot_ptr + seg)
        rank = tl.load(rank_ptr + slot)
        seg_len = tl.load(seg_len_ptr + seg)
        if pid_m * BLOCK_M >= seg_len:
            return
        if pid_n * BLOCK_N >= rank:
            return
        seg_start = tl.load(seg_start_ptr + seg)

        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM] rows of the segment
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] rank columns
        offs_k = pid_sk * BLOCK_K + tl.arange(0, BLOCK_K)  # [BK]
        m_mask = offs_m < seg_len
        n_mask = offs_n < rank
        tok = tl.load(tok_ptr + seg_start + offs_m, mask=m_mask, other=0)  # [BM] int64

        x_ptrs = x_ptr + tok[:, None] * stride_xt + offs_k[None, :] * stride_xk  # [BM, BK]
        a_ptrs = (
            a_ptr
            + slot * stride_a0
            + slice_id * stride_a1
            + offs_n[None, :] * stride_a2
            + offs_k[:, None] * stride_a3
        )  # [BK, BN] = A[slot, slice]^T tile
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(pid_sk * BLOCK_K, K, BLOCK_K * SPLIT_K):
            k_mask = (k0 - pid_sk * BLOCK_K + offs_k) < K
            xt = tl.load(x_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)  # [BM, BK]
            at = tl.load(a_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)  # [BK, BN]
            if USE_DOT:
                acc += tl.dot(xt, at, input_precision=DOT_PRECISION)
            else:
                prod = xt.to(tl.float32)[:, :, None] * at.to(tl.float32)[None, :, :]
                acc += tl.sum(prod, axis=1)  # [BM, BN]
            x_ptrs += BLOCK_K * SPLIT_K * stride_xk
            a_ptrs += BLOCK_K * SPLIT_K * stride_a3
        acc *= tl.load(scale_ptr + slot)

        v_ptrs = (
            v_ptr
            + slice_id * stride_v0
            + (seg_start + offs_m)[:, None] * stride_v1
            + offs_n[None, :] * stride_v2
        )  # [BM, BN]
        out_mask = m_mask[:, None] & n_mask[None, :]
        if SPLIT_K == 1:
            tl.store(v_ptrs, acc, mask=out_mask)
        else:
            tl.atomic_add(v_ptrs, acc, mask=out_mask)

    @triton.jit
    def _expand_kernel(
        v_ptr,  # [num_slices, T_lora, R] fp32
        b_ptr,  # [num_slots, N_total, R]
        y_ptr,  # [T, N_total], updated in place
        tok_ptr,  # [T_lora] int64 sorted_token_idx
        seg_start_ptr,  # [S]
        seg_len_ptr,  # [S]
        seg_slot_ptr,  # [S]
        rank_ptr,  # [num_slots]
        OFF0,
        OFF1,
        OFF2,
        OFF3,  # slice column offsets in y / rows in B (unused ones repeat the last)
        stride_v0,
        stride_v1,
        stride_v2,
        stride_b0,
        stride_b1,
        stride_b2,
        stride_yt,
        stride_yn,
        NUM_N_TILES,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        USE_DOT: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
    ):
        pid = tl.program_id(0)
        slice_id = tl.program_id(1)
        seg = tl.program_id(2)
        pid_m = pid // NUM_N_TILES
        pid_n = pid % NUM_N_TILES

        lo = tl.where(slice_id == 0, OFF0, tl.where(slice_id == 1, OFF1, OFF2))
        hi = tl.where(slice_id == 0, OFF1, tl.where(slice_id == 1, OFF2, OFF3))
        seg_len = tl.load(seg_len_ptr + seg)
        if pid_m * BLOCK_M >= seg_len:
            return
        if pid_n * BLOCK_N >= hi - lo:
            return
        slot = tl.load(seg_slot_ptr + seg)
        rank = tl.load(rank_ptr + slot)
        seg_start = tl.load(seg_start_ptr + seg)

        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] columns within the slice
        offs_k = tl.arange(0, BLOCK_K)  # [BK] rank
        m_mask = offs_m < seg_len
        n_mask = offs_n < hi - lo
        tok = tl.load(tok_ptr + seg_start + offs_m, mask=m_mask, other=0)  # [BM] int64

        v_ptrs = (
            v_ptr
            + slice_id * stride_v0
            + (seg_start + offs_m)[:, None] * stride_v1
            + offs_k[None, :] * stride_v2
        )  # [BM, BK]
        b_ptrs = (
            b_ptr
            + slot * stride_b0
            + (lo + offs_n)[None, :] * stride_b1
            + offs_k[:, None] * stride_b2
        )  # [BK, BN] = B[slot, slice rows]^T tile
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, rank, BLOCK_K):
            k_mask = (k0 + offs_k) < rank
            vt = tl.load(v_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)  # [BM, BK]
            bt = tl.load(b_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)  # [BK, BN]
            if USE_DOT:
                acc += tl.dot(vt.to(bt.dtype), bt, input_precision=DOT_PRECISION)
            else:
                acc += tl.sum(vt[:, :, None] * bt.to(tl.float32)[None, :, :], axis=1)
            v_ptrs += BLOCK_K * stride_v2
            b_ptrs += BLOCK_K * stride_b2

        y_ptrs = y_ptr + tok[:, None] * stride_yt + (lo + offs_n)[None, :] * stride_yn  # [BM, BN]
        out_mask = m_mask[:, None] & n_mask[None, :]
        yt = tl.load(y_ptrs, mask=out_mask, other=0.0)
        tl.store(y_ptrs, (yt.to(tl.float32) + acc).to(yt.dtype), mask=out_mask)


def _require_triton() -> None:
    if not HAS_TRITON:
        raise RuntimeError("the Triton LoRA backend needs the `triton` package")


def shrink_config(
    meta: LoRABatchMeta, K: int, R: int, num_slices: int, device: torch.device, deterministic: bool
) -> dict:
    """Tile sizes and split-K for the shrink kernel, chosen from the step's segment shape."""
    block_m, use_dot = _block_m(meta.max_seg_len)
    if use_dot:
        block_n = _clamp(_next_pow2(R), 16, 64)
        block_k = 64 if K >= 64 else _clamp(_next_pow2(K), 16, 64)
    else:
        block_n = _clamp(_next_pow2(R), 8, 64)
        block_k = _clamp(_DECODE_TILE_ELEMS // (block_m * block_n), 16, 256)
    split_k = 1
    if not deterministic:
        tiles = triton.cdiv(meta.max_seg_len, block_m) * triton.cdiv(R, block_n)
        programs = tiles * num_slices * meta.num_segments
        want = triton.cdiv(2 * _num_sms(device), max(programs, 1))
        split_k = _clamp(_next_pow2(want), 1, min(64, _next_pow2(triton.cdiv(K, block_k))))
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split_k, USE_DOT=use_dot)


def expand_config(meta: LoRABatchMeta, R: int, max_n: int) -> dict:
    """Tile sizes for the expand kernel (no split-K: the reduction is over the rank)."""
    block_m, use_dot = _block_m(meta.max_seg_len)
    if use_dot:
        block_k = _clamp(_next_pow2(R), 16, 64)
        block_n = 64
    else:
        block_k = _clamp(_next_pow2(R), 8, 64)
        block_n = _clamp(_DECODE_TILE_ELEMS // (block_m * block_k), 16, 256)
    block_n = min(block_n, max(16, _next_pow2(max_n)))
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, USE_DOT=use_dot)


def lora_shrink(
    x: torch.Tensor,
    a_stack: torch.Tensor,
    meta: LoRABatchMeta,
    scale: torch.Tensor,
    *,
    deterministic: bool = False,
    config: dict | None = None,
) -> torch.Tensor:
    """Triton shrink -> ``[num_slices, T_lora, R]`` fp32 (see ``ops.lora_shrink``).

    ``config`` overrides the chosen tile sizes / ``SPLIT_K`` (tests and benchmarks).
    """
    _require_triton()
    num_slots, num_slices, R, K = a_stack.shape
    if x.shape != (meta.num_tokens, K):
        raise ValueError(f"x must be [{meta.num_tokens}, {K}]; got {list(x.shape)}")
    if num_slices > _MAX_SLICES:
        raise ValueError(f"at most {_MAX_SLICES} slices are supported; got {num_slices}")
    v = torch.zeros(num_slices, meta.num_lora_tokens, R, dtype=torch.float32, device=x.device)
    if not meta.has_lora:
        return v
    if x.dtype != a_stack.dtype:
        x = x.to(a_stack.dtype)
    scale = scale.to(device=x.device, dtype=torch.float32)
    cfg = shrink_config(meta, K, R, num_slices, x.device, deterministic)
    cfg.update(config or {})
    if deterministic:
        cfg["SPLIT_K"] = 1
    n_tiles = triton.cdiv(R, cfg["BLOCK_N"])
    m_tiles = triton.cdiv(meta.max_seg_len, cfg["BLOCK_M"])
    grid = (cfg["SPLIT_K"] * m_tiles * n_tiles, num_slices, meta.num_segments)
    _shrink_kernel[grid](
        x, a_stack, v, meta.sorted_token_idx, meta.seg_starts, meta.seg_lens, meta.seg_slots,
        meta.slot_ranks, scale, K,
        x.stride(0), x.stride(1),
        *a_stack.stride(),
        *v.stride(),
        n_tiles,
        DOT_PRECISION=_precision(x.dtype),
        **cfg,
    )  # fmt: skip
    return v


def lora_expand(
    v: torch.Tensor,
    b_stack: torch.Tensor,
    meta: LoRABatchMeta,
    y: torch.Tensor,
    slice_offsets: Sequence[int],
    *,
    config: dict | None = None,
) -> None:
    """Triton expand: ``y[tok, slice cols] += B[slot, slice rows] @ v[s, i]`` in place.

    ``slice_offsets`` should be a tuple/list of ints (a tensor costs a device sync).
    """
    _require_triton()
    num_slices, T_lora, R = v.shape
    n_total = b_stack.shape[1]
    offs = [int(o) for o in slice_offsets]
    if len(offs) != num_slices + 1 or offs[0] != 0 or offs[-1] != n_total:
        raise ValueError(
            f"slice_offsets must be {num_slices + 1} ints from 0 to {n_total}; got {offs}"
        )
    if num_slices > _MAX_SLICES:
        raise ValueError(f"at most {_MAX_SLICES} slices are supported; got {num_slices}")
    if y.shape != (meta.num_tokens, n_total):
        raise ValueError(f"y must be [{meta.num_tokens}, {n_total}]; got {list(y.shape)}")
    if not meta.has_lora:
        return
    max_n = max(b - a for a, b in zip(offs, offs[1:], strict=False))
    if max_n == 0:
        return
    cfg = expand_config(meta, R, max_n)
    cfg.update(config or {})
    n_tiles = triton.cdiv(max_n, cfg["BLOCK_N"])
    m_tiles = triton.cdiv(meta.max_seg_len, cfg["BLOCK_M"])
    offs4 = offs + [offs[-1]] * (_MAX_SLICES + 1 - len(offs))
    grid = (m_tiles * n_tiles, num_slices, meta.num_segments)
    _expand_kernel[grid](
        v, b_stack, y, meta.sorted_token_idx, meta.seg_starts, meta.seg_lens, meta.seg_slots,
        meta.slot_ranks, *offs4,
        *v.stride(),
        *b_stack.stride(),
        y.stride(0), y.stride(1),
        n_tiles,
        DOT_PRECISION=_precision(b_stack.dtype),
        **cfg,
    )  # fmt: skip
