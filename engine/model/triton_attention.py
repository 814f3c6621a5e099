"""Triton paged attention (CUDA): varlen queries over the paged KV cache.

One program per (query tile of one sequence, query head). A tile holds up to
``BLOCK_M`` consecutive new tokens of one sequence (a decode is a tile of one);
it walks the sequence's context in ``BLOCK_N``-key steps through its block table,
with an online softmax in fp32, and never reads past the causal limit of its last
row. Nothing is padded to the longest sequence: the grid has Σ ceil(n_i / BLOCK_M)
tiles per head and each reads only its own context. Tested on the CPU under
``TRITON_INTERPRET=1`` (fp32/fp16); timed only on a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

BLOCK_M = 16
BLOCK_N = 16


@dataclass
class TritonAttentionMetadata:
    """Per-step tensors of the kernel, built once by :func:`build_triton_metadata`."""

    block_tables: torch.Tensor  # [B, max_blocks] int32
    tile_seq: torch.Tensor  # [tiles] int32: sequence of each query tile
    tile_row: torch.Tensor  # [tiles] int32: first step row of the tile
    tile_rows: torch.Tensor  # [tiles] int32: rows in the tile (<= BLOCK_M)
    tile_pos: torch.Tensor  # [tiles] int32: position of the tile's first row
    block_size: int
    max_ctx: int


def build_triton_metadata(
    block_tables: list[list[int]], starts: list[int], num_new: list[int], device: torch.device,
    block_size: int = 16,
) -> TritonAttentionMetadata:
    width = max(len(t) for t in block_tables)
    tables = torch.tensor([t + [0] * (width - len(t)) for t in block_tables], dtype=torch.int32)
    seq, row0, rows, pos = [], [], [], []
    row = 0
    for i, (s, n) in enumerate(zip(starts, num_new, strict=True)):
        for t in range(0, n, BLOCK_M):
            seq.append(i)
            row0.append(row + t)
            rows.append(min(BLOCK_M, n - t))
            pos.append(s + t)
        row += n

    def dev(x):
        return torch.tensor(x, dtype=torch.int32).to(device)

    return TritonAttentionMetadata(
        tables.to(device), dev(seq), dev(row0), dev(rows), dev(pos), block_size,
        max(s + n for s, n in zip(starts, num_new, strict=True)),
    )


@triton.jit
def _paged_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, tables_ptr,
    tile_seq_ptr, tile_row_ptr, tile_rows_ptr, tile_pos_ptr,
    stride_qt, stride_qh, stride_ks, stride_kh, stride_ot, stride_oh, stride_tb,
    scale, window, softcap,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr, USE_WINDOW: tl.constexpr,
    USE_SOFTCAP: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    tile = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // GROUP
    seq = tl.load(tile_seq_ptr + tile)
    row0 = tl.load(tile_row_ptr + tile)
    nrows = tl.load(tile_rows_ptr + tile)
    pos0 = tl.load(tile_pos_ptr + tile)
    m_idx = tl.arange(0, BLOCK_M)
    d_idx = tl.arange(0, BLOCK_D)
    row_ok = m_idx < nrows
    d_ok = d_idx < HEAD_DIM
    q = tl.load(
        q_ptr + (row0 + m_idx)[:, None] * stride_qt + head * stride_qh + d_idx[None, :],
        mask=row_ok[:, None] & d_ok[None, :], other=0.0,
    )  # [M, D]
    q_pos = pos0 + m_idx  # [M]
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    end = pos0 + nrows  # keys 0..end-1 are visible to some row of the tile
    start = 0
    if USE_WINDOW:
        start = tl.maximum(pos0 - window + 1, 0) // BLOCK_N * BLOCK_N
    for k0 in range(start, end, BLOCK_N):
        k_pos = k0 + tl.arange(0, BLOCK_N)  # [N]
        k_ok = k_pos < end
        block = tl.load(tables_ptr + seq * stride_tb + k_pos // PAGE, mask=k_ok, other=0)
        slot = block.to(tl.int64) * PAGE + k_pos % PAGE
        kv_off = slot[:, None] * stride_ks + kv_head * stride_kh + d_idx[None, :]
        kv_mask = k_ok[:, None] & d_ok[None, :]
        k = tl.load(k_cache_ptr + kv_off, mask=kv_mask, other=0.0)  # [N, D]
        v = tl.load(v_cache_ptr + kv_off, mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION).to(tl.float32) * scale  # [M, N]
        if USE_SOFTCAP:  # cap * tanh(s / cap), tanh from exp (saturates to +-1)
            s = softcap * (1.0 - 2.0 / (tl.exp(2.0 * s / softcap) + 1.0))
        visible = (k_pos[None, :] <= q_pos[:, None]) & k_ok[None, :]
        if USE_WINDOW:
            visible = visible & (k_pos[None, :] > q_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION).to(tl.float32)
        m_i = m_new
    o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(
        out_ptr + (row0 + m_idx)[:, None] * stride_ot + head * stride_oh + d_idx[None, :],
        o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :],
    )


def triton_paged_attention(
    q: torch.Tensor,  # [T, H, D]
    k_cache: torch.Tensor,  # [S, Hkv, D]
    v_cache: torch.Tensor,  # [S, Hkv, D]
    meta: TritonAttentionMetadata,
    window: int | None,
    *,
    scale: float | None = None,
    softcap: float | None = None,
) -> torch.Tensor:  # [T, H * D]
    """``scale``: softmax scale (None: ``head_dim ** -0.5``); ``softcap``: logits capped as
    ``cap * tanh(s / cap)`` (None: no cap)."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv = k_cache.shape[1]
    q = q.contiguous()
    out = q.new_empty(num_tokens, num_heads, head_dim)
    grid = (meta.tile_seq.numel(), num_heads)
    _paged_attention_kernel[grid](
        q, k_cache, v_cache, out, meta.block_tables,
        meta.tile_seq, meta.tile_row, meta.tile_rows, meta.tile_pos,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
        out.stride(0), out.stride(1), meta.block_tables.stride(0),
        head_dim ** -0.5 if scale is None else scale, window or 0, softcap or 1.0,
        GROUP=num_heads // num_kv, HEAD_DIM=head_dim, BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, PAGE=meta.block_size, USE_WINDOW=window is not None,
        USE_SOFTCAP=bool(softcap),
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else None,  # fp32: no TF32
    )
    return out.view(num_tokens, num_heads * head_dim)
