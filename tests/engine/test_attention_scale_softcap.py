"""Paged attention with a family's softmax scale (Gemma's ``query_pre_attn_scalar``) and a
logit soft-cap (``cap * tanh(s / cap)``), per-layer windows: the torch path (decode groups,
fresh prompts, chunks over a cached prefix), the CPU C kernel (scale) and the Triton kernel
(``TRITON_INTERPRET=1``, fp32) against a dense float64 reference."""

from __future__ import annotations

import math

import pytest
import torch

from loramux.engine.model.attention import (
    build_attention_metadata,
    build_step_attention,
    paged_attention,
    write_kv,
)

BLOCK = 4
ROWS = [(4, 1), (19, 1), (0, 7), (13, 9)]  # (computed before, new): 2 decodes, a fresh prompt, a chunk
NUM_DECODE = 2
PAD = 64 * BLOCK


def make_case(dtype, head_dim=16, heads=4, kv_heads=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    tables, blocks = [], iter(torch.randperm(64, generator=g).tolist())
    for start, n in ROWS:
        tables.append([next(blocks) for _ in range(-(-(start + n) // BLOCK))])
    total = sum(n for _, n in ROWS)
    q = (torch.randn(total, heads, head_dim, generator=g) * 2).to(dtype)
    cache = [torch.cat([torch.randn(64 * BLOCK, kv_heads, head_dim, generator=g),
                        torch.zeros(1, kv_heads, head_dim)]).to(dtype) for _ in range(2)]
    k = torch.randn(total, kv_heads, head_dim, generator=g).to(dtype)
    v = torch.randn(total, kv_heads, head_dim, generator=g).to(dtype)
    return tables, q, k, v, cache[0], cache[1]


def dense(tables, q, k_cache, v_cache, window, scale, softcap):
    out, row = [], 0
    heads, kv_heads = q.shape[1], k_cache.shape[1]
    for (start, n), table in zip(ROWS, tables, strict=True):
        ctx = start + n
        slots = torch.tensor([table[p // BLOCK] * BLOCK + p % BLOCK for p in range(ctx)])
        keys = k_cache[slots].double().repeat_interleave(heads // kv_heads, dim=1)
        vals = v_cache[slots].double().repeat_interleave(heads // kv_heads, dim=1)
        s = torch.einsum("nhd,khd->hnk", q[row : row + n].double(), keys) * scale
        if softcap:
            s = torch.tanh(s / softcap) * softcap
        q_pos, k_pos = torch.arange(start, ctx).unsqueeze(1), torch.arange(ctx).unsqueeze(0)
        visible = k_pos <= q_pos
        if window is not None:
            visible &= k_pos > q_pos - window
        s = s.masked_fill(~visible, float("-inf"))
        out.append(torch.einsum("hnk,khd->nhd", s.softmax(-1), vals).reshape(n, -1))
        row += n
    return torch.cat(out)


def metadata(tables, window, cpu_kernel=False):
    return build_attention_metadata(tables, [s for s, _ in ROWS], [n for _, n in ROWS], NUM_DECODE, BLOCK,
                                    window, torch.device("cpu"), pad_slot=PAD, cpu_kernel=cpu_kernel)


@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("scale,softcap", [(24**-0.5, None), (0.25, None), (16**-0.5, 5.0), (0.5, 2.0)])
def test_torch_path_scale_and_softcap(window, scale, softcap):
    tables, q, k, v, k_cache, v_cache = make_case(torch.float32)
    meta = metadata(tables, window)
    assert meta.decode_groups and meta.prefills and (meta.fresh_groups or window is not None)
    write_kv(k_cache, v_cache, k, v, meta)
    got = paged_attention(q, k, v, k_cache, v_cache, meta, scale=scale, softcap=softcap)
    torch.testing.assert_close(got.double(), dense(tables, q, k_cache, v_cache, window, scale, softcap),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [None, 6])
def test_cpu_kernel_takes_the_scale_and_softcap(window):
    from support.cpu_kernel import require_cpu_kernel

    require_cpu_kernel()
    tables, q, k, v, k_cache, v_cache = make_case(torch.float32)
    meta = metadata(tables, window, cpu_kernel=True)
    assert meta.cpu is not None
    write_kv(k_cache, v_cache, k, v, meta)
    got = paged_attention(q, k, v, k_cache, v_cache, meta, scale=24**-0.5)
    torch.testing.assert_close(got.double(), dense(tables, q, k_cache, v_cache, window, 24**-0.5, None),
                               atol=1e-5, rtol=1e-5)
    got = paged_attention(q, k, v, k_cache, v_cache, meta, scale=24**-0.5, softcap=5.0)
    torch.testing.assert_close(got.double(), dense(tables, q, k_cache, v_cache, window, 24**-0.5, 5.0),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("scale,softcap", [(None, None), (24**-0.5, 3.0)])
def test_triton_kernel_scale_and_softcap(window, scale, softcap):
    pytest.importorskip("triton")
    from loramux.engine.model.triton_attention import build_triton_metadata, triton_paged_attention

    tables, q, k, v, k_cache, v_cache = make_case(torch.float32)
    write_kv(k_cache, v_cache, k, v, metadata(tables, window))
    tmeta = build_triton_metadata(tables, [s for s, _ in ROWS], [n for _, n in ROWS], q.device, BLOCK)
    got = triton_paged_attention(q, k_cache, v_cache, tmeta, window, scale=scale, softcap=softcap)
    want = dense(tables, q, k_cache, v_cache, window, scale or 1 / math.sqrt(q.shape[-1]), softcap)
    torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-4)


def test_step_attention_has_one_metadata_per_window():
    tables, *_ = make_case(torch.float32)
    metas = build_step_attention(tables, [s for s, _ in ROWS], [n for _, n in ROWS], NUM_DECODE, BLOCK,
                                 (6, None), torch.device("cpu"), pad_slot=PAD)
    assert set(metas) == {6, None} and metas[6].window == 6 and metas[None].window is None
    assert torch.equal(metas[6].slot_mapping, metas[None].slot_mapping)
