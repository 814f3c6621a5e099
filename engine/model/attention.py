"""Attention over the paged KV cache in plain torch (CPU and CUDA).

The runner orders a step's tokens as: decode tokens first (one per sequence),
then each prefilling sequence's tokens contiguously. Decode attention gathers
each sequence's keys and values from the cache through its slot indices;
prefill attention uses the fresh keys and values of the prompt directly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class AttentionMetadata:
    """Built once per step by the runner, read by every layer."""

    slot_mapping: torch.Tensor  # [T] int64: cache slot of each new token's K/V
    num_decode: int  # rows 0..num_decode-1 are decode tokens
    decode_kv_idx: torch.Tensor | None  # [Bd, Ld] int64 cache slots of each decode seq's context
    decode_mask: torch.Tensor | None  # [Bd, 1, 1, Ld] bool, None when every context is Ld long
    prefill_lens: list[int]  # tokens of each prefilling sequence, in row order
    prefill_gather: torch.Tensor | None  # [Bp, Lp] rows of the padded prefill batch (None: same lengths)
    prefill_mask: torch.Tensor | None  # [Bp, 1, Lp, Lp] bool, None when causal alone suffices
    prefill_unpad: torch.Tensor | None  # [Tp] indices into the flattened padded batch


def write_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
) -> None:
    """Store the step's keys/values ([T, Hkv, D]) into the caches ([S, Hkv, D])."""
    k_cache.index_copy_(0, meta.slot_mapping, k)
    v_cache.index_copy_(0, meta.slot_mapping, v)


def paged_attention(
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, Hkv, D] fresh keys of this step
    v: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [S, Hkv, D]
    v_cache: torch.Tensor,  # [S, Hkv, D]
    meta: AttentionMetadata,
) -> torch.Tensor:  # [T, H * D]
    """Causal attention of every new token over its sequence's context."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv = k.shape[1]
    out = q.new_empty(num_tokens, num_heads * head_dim)
    nd = meta.num_decode
    if nd:
        out[:nd] = _decode(q[:nd], k_cache, v_cache, meta, num_kv)
    if meta.prefill_lens:
        out[nd:] = _prefill(q[nd:], k[nd:], v[nd:], meta)
    return out


def _decode(q, k_cache, v_cache, meta: AttentionMetadata, num_kv: int) -> torch.Tensor:
    bd, num_heads, head_dim = q.shape
    idx = meta.decode_kv_idx  # [Bd, Ld]
    ld = idx.shape[1]
    flat = idx.reshape(-1)
    keys = k_cache.index_select(0, flat).view(bd, ld, num_kv, head_dim).transpose(1, 2)
    vals = v_cache.index_select(0, flat).view(bd, ld, num_kv, head_dim).transpose(1, 2)
    # Fold the query heads of each KV group into the query axis: [Bd, Hkv, G, D].
    qg = q.view(bd, num_kv, num_heads // num_kv, head_dim)
    o = F.scaled_dot_product_attention(qg, keys, vals, attn_mask=meta.decode_mask)
    return o.reshape(bd, num_heads * head_dim)


def _prefill(q, k, v, meta: AttentionMetadata) -> torch.Tensor:
    tp, num_heads, head_dim = q.shape
    num_kv = k.shape[1]
    lens = meta.prefill_lens
    bp = len(lens)
    if meta.prefill_gather is None:
        lp = lens[0]
        qp, kp, vp = (t.view(bp, lp, -1, head_dim).transpose(1, 2) for t in (q, k, v))
    else:
        lp = meta.prefill_gather.shape[1]
        g = meta.prefill_gather.reshape(-1)
        qp, kp, vp = (
            t.index_select(0, g).view(bp, lp, -1, head_dim).transpose(1, 2) for t in (q, k, v)
        )
    if meta.prefill_mask is None:
        o = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, enable_gqa=num_kv != num_heads)
    else:
        o = F.scaled_dot_product_attention(
            qp, kp, vp, attn_mask=meta.prefill_mask, enable_gqa=num_kv != num_heads
        )
    o = o.transpose(1, 2).reshape(bp * lp, num_heads * head_dim)
    if meta.prefill_unpad is not None:
        o = o.index_select(0, meta.prefill_unpad)
    return o
