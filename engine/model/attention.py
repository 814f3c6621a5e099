"""Attention over the paged KV cache, without padding to the longest sequence.

Every row of a step (a decode token, or a chunk of a prompt that may continue an
already computed prefix) attends to its own sequence's context, read from the
paged cache after this step's keys and values are written. The work of a step is
Σ(new tokens × their context) up to a small bounded padding inside groups of
similar decodes, and its temporary memory is bounded by the tiles below, never by
(number of sequences × longest length²).

Three backends read the same :class:`AttentionMetadata`: plain torch (CPU, and the
reference), a C kernel that reads the blocks in place (CPU, ``cpu_attention.py``) and a
Triton kernel (CUDA, ``triton_attention.py``).

Layers may differ in their sliding window (Gemma 3's local / global pattern): the runner
builds one metadata per distinct window (:func:`build_step_attention`) and each layer reads
its own. The softmax ``scale`` (default ``head_dim ** -0.5``) and a logit ``softcap``
(``cap * tanh(s / cap)``) are per call.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import accumulate

import torch
import torch.nn.functional as F

DECODE_TILE_KEYS = 1 << 15
"""Most (decodes × padded context) keys one batched decode attention call gathers."""
DECODE_PAD_SLACK = 1.25
"""Decodes share a call while the longest context is within this factor of the shortest."""
PREFILL_TILE_SCORES = 1 << 22
"""Most (query rows × context keys) one prefill attention call holds as a mask."""


@dataclass
class DecodeGroup:
    """Decode rows of similar context length, attended in one batched call."""

    rows: torch.Tensor  # [b] int64 rows of the step (all < num_decode)
    kv_idx: torch.Tensor  # [b, L] int64 cache slots of each row's context (padded)
    mask: torch.Tensor | None  # [b, 1, 1, L] bool; None when every context is L long


@dataclass
class PrefillItem:
    """A prompt chunk: rows ``start .. start + n - 1`` of the step, positions ``ctx - n .. ctx - 1``."""

    start: int
    n: int
    ctx: int
    kv_idx: torch.Tensor | None  # [ctx] int64 cache slots; None = fresh prompt (keys are this step's)


@dataclass
class FreshPrefillGroup:
    """Fresh prompts of equal length (no cached prefix, no window): one causal call."""

    starts: list[int]
    n: int


@dataclass
class AttentionMetadata:
    """Built once per step by :func:`build_attention_metadata`, read by every layer."""

    slot_mapping: torch.Tensor  # [T] int64: cache slot of each new token's K/V
    num_decode: int  # rows 0..num_decode-1 are decode tokens
    window: int | None = None  # sliding window (keys within the last ``window`` positions)
    pad_slot: int = -1  # the zeroed cache slot padded positions read (set by the builder)
    decode_groups: list[DecodeGroup] = field(default_factory=list)
    prefills: list[PrefillItem] = field(default_factory=list)
    fresh_groups: list[FreshPrefillGroup] = field(default_factory=list)
    triton: object | None = None  # TritonAttentionMetadata on CUDA
    cpu: object | None = None  # CpuAttentionMetadata: rows the C kernel attends (CPU)


def build_attention_metadata(
    block_tables: list[list[int]],
    starts: list[int],
    num_new: list[int],
    num_decode: int,
    block_size: int,
    window: int | None,
    device: torch.device,
    *,
    pad_slot: int,
    cpu_kernel: bool = False,
) -> AttentionMetadata:
    """Per-step metadata; row ``i`` computes positions ``starts[i] .. starts[i] + num_new[i] - 1``
    of a sequence whose KV lives in ``block_tables[i]``. Called by the runner once a step.
    ``pad_slot`` is the cache's dedicated zeroed slot (``block_manager.pad_slot``): padded
    positions read it, never another sequence's cache (a masked NaN key or value still
    turns ``scaled_dot_product_attention``'s output into NaN). ``cpu_kernel``: on the CPU,
    rows that read cached context go to the C kernel, which reads no padding (the caller
    checked ``cpu_attention.kernel_available()``)."""
    tables = [torch.tensor(t, dtype=torch.long) for t in block_tables]
    slots = []
    for t, s, n in zip(tables, starts, num_new, strict=True):
        pos = torch.arange(s, s + n)
        slots.append(t[pos // block_size] * block_size + pos % block_size)
    meta = AttentionMetadata(torch.cat(slots).to(device), num_decode, window, pad_slot=pad_slot)
    if device.type == "cuda":
        from loramux.engine.model.triton_attention import build_triton_metadata

        meta.triton = build_triton_metadata(block_tables, starts, num_new, device, block_size)
        return meta
    if cpu_kernel and device.type == "cpu":
        _plan_cpu_kernel(meta, block_tables, starts, num_new, block_size, window)
        return meta
    arange_block = torch.arange(block_size)

    def context_slots(row: int, length: int) -> torch.Tensor:
        t = tables[row][: -(-length // block_size)]
        return (t[:, None] * block_size + arange_block).reshape(-1)[:length]

    _plan_decodes(meta, starts[:num_decode], context_slots, device, pad_slot)
    row = num_decode
    fresh: dict[int, list[int]] = {}
    for i in range(num_decode, len(starts)):
        s, n = starts[i], num_new[i]
        if s == 0 and (window is None or n <= window):
            fresh.setdefault(n, []).append(row)
        else:
            meta.prefills.append(PrefillItem(row, n, s + n, context_slots(i, s + n).to(device)))
        row += n
    meta.fresh_groups = [FreshPrefillGroup(rows, n) for n, rows in fresh.items()]
    return meta


def build_step_attention(
    block_tables: list[list[int]],
    starts: list[int],
    num_new: list[int],
    num_decode: int,
    block_size: int,
    windows: tuple[int | None, ...],
    device: torch.device,
    *,
    pad_slot: int,
    cpu_kernel: bool = False,
) -> dict[int | None, AttentionMetadata]:
    """:func:`build_attention_metadata` for every sliding window the model's layers use
    (``DecoderModel.attention_windows``); called by the runner once a step."""
    metas: dict[int | None, AttentionMetadata] = {}
    for window in windows:
        metas[window] = build_attention_metadata(
            block_tables, starts, num_new, num_decode, block_size, window, device,
            pad_slot=pad_slot, cpu_kernel=cpu_kernel,
        )
    return metas


def _plan_cpu_kernel(meta, block_tables, starts, num_new, block_size, window) -> None:
    """Every row of the step to the C kernel: decodes, prompt chunks over a cached prefix and
    fresh prompts alike (its prompt tiles ran fresh causal prompts 1.2-1.9x faster than
    torch's SDPA up to 1024 tokens on an AVX-512 EPYC, level at 2048; bench/attention_prefill.py)."""
    from loramux.engine.model.cpu_attention import build_cpu_metadata

    row_starts = list(accumulate(num_new[:-1], initial=0))[: len(num_new)]
    meta.cpu = build_cpu_metadata(block_tables, row_starts, starts, num_new, block_size, window)


def _plan_decodes(meta: AttentionMetadata, starts: list[int], context_slots, device, pad: int) -> None:
    """Group decode rows by context length: bounded padding (reading the zeroed ``pad``
    slot), bounded gather per call."""
    order = sorted(range(len(starts)), key=lambda r: starts[r])
    i = 0
    while i < len(order):
        lo = starts[order[i]] + 1
        j = i + 1
        while j < len(order):
            hi = starts[order[j]] + 1
            if hi > lo * DECODE_PAD_SLACK + 16 or (j - i + 1) * hi > DECODE_TILE_KEYS:
                break
            j += 1
        rows = order[i:j]
        lens = torch.tensor([starts[r] + 1 for r in rows])
        length = int(lens.max())
        idx = torch.stack(
            [F.pad(context_slots(r, starts[r] + 1), (0, length - starts[r] - 1), value=pad) for r in rows]
        )
        key_pos = torch.arange(length).unsqueeze(0)
        valid = key_pos < lens.unsqueeze(1)
        if meta.window is not None:
            valid &= key_pos >= (lens.unsqueeze(1) - meta.window)
        mask = None if bool(valid.all()) else valid[:, None, None, :].to(device)
        meta.decode_groups.append(DecodeGroup(torch.tensor(rows).to(device), idx.to(device), mask))
        i = j


def write_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
) -> None:
    """Store the step's keys/values ([T, Hkv, D]) into the caches ([S, Hkv, D])."""
    k_cache.index_copy_(0, meta.slot_mapping, k)
    v_cache.index_copy_(0, meta.slot_mapping, v)


def paged_attention(
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, Hkv, D] fresh keys of this step (already in the cache)
    v: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [S, Hkv, D]
    v_cache: torch.Tensor,  # [S, Hkv, D]
    meta: AttentionMetadata,
    *,
    scale: float | None = None,
    softcap: float | None = None,
) -> torch.Tensor:  # [T, H * D]
    """Causal attention of every new token over its sequence's context; ``scale`` is the
    softmax scale (None: ``head_dim ** -0.5``), ``softcap`` caps the logits (None: no cap)."""
    if meta.triton is not None:
        from loramux.engine.model.triton_attention import triton_paged_attention

        return triton_paged_attention(q, k_cache, v_cache, meta.triton, meta.window,
                                      scale=scale, softcap=softcap)
    num_tokens, num_heads, head_dim = q.shape
    num_kv = k.shape[1]
    group = num_heads // num_kv
    out = q.new_empty(num_tokens, num_heads * head_dim)
    if meta.cpu is not None:
        from loramux.engine.model.cpu_attention import cpu_paged_attention

        cpu_paged_attention(q, k_cache, v_cache, out, meta.cpu, scale=scale, softcap=softcap or 0.0)
    for g in meta.decode_groups:
        b, length = g.kv_idx.shape
        flat = g.kv_idx.reshape(-1)
        keys = k_cache.index_select(0, flat).view(b, length, num_kv, head_dim).transpose(1, 2)
        vals = v_cache.index_select(0, flat).view(b, length, num_kv, head_dim).transpose(1, 2)
        qg = q.index_select(0, g.rows).view(b, num_kv, group, head_dim)  # [b, Hkv, G, D]
        o = _sdpa(qg, keys, vals, g.mask, scale=scale, softcap=softcap)
        out.index_copy_(0, g.rows, o.reshape(b, num_heads * head_dim))
    for fg in meta.fresh_groups:
        n = fg.n
        rows = torch.cat([torch.arange(s, s + n) for s in fg.starts]) if len(fg.starts) > 1 else None
        qs, ks, vs = (
            (t[fg.starts[0] : fg.starts[0] + n] if rows is None else t.index_select(0, rows.to(t.device)))
            .view(len(fg.starts), n, -1, head_dim)
            .transpose(1, 2)
            for t in (q, k, v)
        )
        o = _sdpa(qs, ks, vs, None, scale=scale, softcap=softcap, causal=True)
        o = o.transpose(1, 2).reshape(-1, num_heads * head_dim)
        if rows is None:
            out[fg.starts[0] : fg.starts[0] + n] = o
        else:
            out.index_copy_(0, rows.to(out.device), o)
    for p in meta.prefills:
        out[p.start : p.start + p.n] = _chunk(q[p.start : p.start + p.n], k_cache, v_cache, p, meta.window,
                                              scale, softcap)
    return out


def _sdpa(q, k, v, mask, *, scale: float | None, softcap: float | None, causal: bool = False):
    """Attention of q [B, Hkv, G*, D] (or [B, H, n, D]) over k/v [B, Hkv, L, D]: torch's SDPA,
    or with a soft-cap the same computed step by step (SDPA has no cap)."""
    group = q.shape[1] // k.shape[1]
    if not softcap:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                              scale=scale, enable_gqa=group > 1)
    if group > 1:
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    s = (q @ k.transpose(-1, -2)).float() * (scale if scale is not None else q.shape[-1] ** -0.5)
    s = torch.tanh(s / softcap) * softcap
    if causal:
        n, length = s.shape[-2], s.shape[-1]
        mask = torch.ones(n, length, dtype=torch.bool, device=s.device).tril(length - n)
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    return (torch.softmax(s, dim=-1).to(v.dtype)) @ v


def _chunk(q, k_cache, v_cache, item: PrefillItem, window: int | None, scale=None,
           softcap=None) -> torch.Tensor:
    """One prompt chunk over its whole context, in query tiles of bounded mask size."""
    n, num_heads, head_dim = q.shape
    num_kv = k_cache.shape[1]
    group = num_heads // num_kv
    keys = k_cache.index_select(0, item.kv_idx).transpose(0, 1).unsqueeze(0)  # [1, Hkv, ctx, D]
    vals = v_cache.index_select(0, item.kv_idx).transpose(0, 1).unsqueeze(0)
    key_pos = torch.arange(item.ctx, device=q.device)
    tile = max(1, min(n, PREFILL_TILE_SCORES // item.ctx))
    out = q.new_empty(n, num_heads * head_dim)
    for t0 in range(0, n, tile):
        t1 = min(n, t0 + tile)
        q_pos = torch.arange(item.ctx - n + t0, item.ctx - n + t1, device=q.device)
        mask = key_pos.unsqueeze(0) <= q_pos.unsqueeze(1)  # [m, ctx]
        if window is not None:
            mask &= key_pos.unsqueeze(0) > (q_pos.unsqueeze(1) - window)
        # fold each KV group's query heads into the query axis: [1, Hkv, G * m, D]
        m = t1 - t0
        qg = q[t0:t1].view(m, num_kv, group, head_dim).permute(1, 2, 0, 3).reshape(1, num_kv, group * m, head_dim)
        o = _sdpa(qg, keys, vals, mask.repeat(group, 1), scale=scale, softcap=softcap)
        out[t0:t1] = o.view(num_kv, group, m, head_dim).permute(2, 0, 1, 3).reshape(m, -1)
    return out
