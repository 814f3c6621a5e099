"""Unpadded paged attention: the torch path against a dense per-sequence reference, and
the Triton kernel (``TRITON_INTERPRET=1`` on the CPU, fp32/fp16) against the torch path."""

from __future__ import annotations

import math

import pytest
import torch

from loramux.engine.model.attention import build_attention_metadata, paged_attention, write_kv

BLOCK = 4
# (computed before the step, new tokens): decodes first, then a fresh prompt and a chunk
ROWS = [(4, 1), (19, 1), (0, 7), (13, 9)]
NUM_DECODE = 2
PAD = 64 * BLOCK  # pad_slot(64, BLOCK)


def make_case(dtype, head_dim=32, heads=4, kv_heads=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    tables, blocks = [], iter(torch.randperm(64, generator=g).tolist())
    for start, n in ROWS:
        tables.append([next(blocks) for _ in range(-(-(start + n) // BLOCK))])
    total = sum(n for _, n in ROWS)
    q = torch.randn(total, heads, head_dim, generator=g).to(dtype)
    # 64 blocks and the zeroed pad slot after them (block_manager.pad_slot)
    k_cache = torch.cat([torch.randn(64 * BLOCK, kv_heads, head_dim, generator=g), torch.zeros(1, kv_heads, head_dim)]).to(dtype)
    v_cache = torch.cat([torch.randn(64 * BLOCK, kv_heads, head_dim, generator=g), torch.zeros(1, kv_heads, head_dim)]).to(dtype)
    k = torch.randn(total, kv_heads, head_dim, generator=g).to(dtype)
    v = torch.randn(total, kv_heads, head_dim, generator=g).to(dtype)
    return tables, q, k, v, k_cache, v_cache


def dense_reference(tables, q, k_cache, v_cache, window):
    """Per sequence, plain softmax attention in float64 over the context read block by block."""
    out, row = [], 0
    heads, kv_heads = q.shape[1], k_cache.shape[1]
    for (start, n), table in zip(ROWS, tables, strict=True):
        ctx = start + n
        slots = torch.tensor([table[p // BLOCK] * BLOCK + p % BLOCK for p in range(ctx)])
        keys = k_cache[slots].double().repeat_interleave(heads // kv_heads, dim=1)  # [ctx, H, D]
        vals = v_cache[slots].double().repeat_interleave(heads // kv_heads, dim=1)
        qs = q[row : row + n].double()
        scores = torch.einsum("nhd,khd->hnk", qs, keys) / math.sqrt(q.shape[-1])
        q_pos = torch.arange(start, ctx).unsqueeze(1)
        k_pos = torch.arange(ctx).unsqueeze(0)
        visible = k_pos <= q_pos
        if window is not None:
            visible &= k_pos > q_pos - window
        scores = scores.masked_fill(~visible, float("-inf"))
        out.append(torch.einsum("hnk,khd->nhd", scores.softmax(-1), vals).reshape(n, -1))
        row += n
    return torch.cat(out)


def run_torch(tables, q, k, v, k_cache, v_cache, window):
    meta = build_attention_metadata(
        tables, [s for s, _ in ROWS], [n for _, n in ROWS], NUM_DECODE, BLOCK, window, torch.device("cpu"),
        pad_slot=PAD,
    )
    write_kv(k_cache, v_cache, k, v, meta)
    return paged_attention(q, k, v, k_cache, v_cache, meta), meta


@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (4, 4), (8, 1)])
def test_torch_path_equals_dense_attention(window, heads, kv_heads):
    tables, q, k, v, k_cache, v_cache = make_case(torch.float32, heads=heads, kv_heads=kv_heads)
    got, meta = run_torch(tables, q, k, v, k_cache, v_cache, window)
    assert meta.prefills and meta.decode_groups  # the chunk continues a computed prefix
    torch.testing.assert_close(got.double(), dense_reference(tables, q, k_cache, v_cache, window),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("poison", [float("nan"), float("inf")])
def test_padding_never_reads_another_sequences_cache(poison):
    """Every slot no row of the step owns (slot 0 included) holds NaN/Inf, as a poisoned
    sequence's cache would: decode rows of different lengths (padded in one group) still
    equal the dense reference, finite."""
    rows = [(4, 1), (6, 1), (9, 1)]
    g = torch.Generator().manual_seed(1)
    blocks = iter(range(1, 64))  # block 0 (slot 0) belongs to nobody here
    tables = [[next(blocks) for _ in range(-(-(s + n) // BLOCK))] for s, n in rows]
    k_cache = torch.cat([torch.randn(64 * BLOCK, 2, 32, generator=g), torch.zeros(1, 2, 32)])
    v_cache = torch.cat([torch.randn(64 * BLOCK, 2, 32, generator=g), torch.zeros(1, 2, 32)])
    owned = {b * BLOCK + i for t in tables for b in t for i in range(BLOCK)}
    foreign = torch.tensor([i for i in range(64 * BLOCK) if i not in owned])
    k_cache[foreign] = poison
    v_cache[foreign] = poison
    q = torch.randn(3, 4, 32, generator=g)
    k, v = torch.randn(3, 2, 32, generator=g), torch.randn(3, 2, 32, generator=g)
    meta = build_attention_metadata(tables, [s for s, _ in rows], [1, 1, 1], 3, BLOCK, None,
                                    torch.device("cpu"), pad_slot=PAD)
    assert len(meta.decode_groups) == 1 and meta.decode_groups[0].mask is not None  # padded
    write_kv(k_cache, v_cache, k, v, meta)
    got = paged_attention(q, k, v, k_cache, v_cache, meta)
    assert torch.isfinite(got).all()
    for i, (s, _) in enumerate(rows):
        slots = torch.tensor([tables[i][p // BLOCK] * BLOCK + p % BLOCK for p in range(s + 1)])
        keys = k_cache[slots].repeat_interleave(2, dim=1).transpose(0, 1)  # [H, ctx, D]
        vals = v_cache[slots].repeat_interleave(2, dim=1).transpose(0, 1)
        ref = torch.softmax(q[i].unsqueeze(1) @ keys.transpose(1, 2) / 32**0.5, -1) @ vals
        torch.testing.assert_close(got[i], ref.reshape(-1), atol=1e-5, rtol=1e-5)


def test_decodes_of_very_different_lengths_are_not_padded_together():
    starts = [3, 5, 900, 1000]
    tables = [list(range(i * 300, i * 300 + -(-(s + 1) // BLOCK))) for i, s in enumerate(starts)]
    meta = build_attention_metadata(tables, starts, [1] * 4, 4, BLOCK, None, torch.device("cpu"), pad_slot=0)
    widths = sorted(g.kv_idx.shape[1] for g in meta.decode_groups)
    assert widths == [6, 1001]  # the short pair padded to 6 keys, the long pair to 1001


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.float16, 2e-2)])
@pytest.mark.parametrize("window", [None, 6])
def test_triton_kernel_equals_torch_path(dtype, tol, window):
    pytest.importorskip("triton")
    from loramux.engine.model.triton_attention import build_triton_metadata, triton_paged_attention

    tables, q, k, v, k_cache, v_cache = make_case(dtype)
    k32, v32 = k_cache.float(), v_cache.float()
    _, meta = run_torch(tables, q.float(), k.float(), v.float(), k32, v32, window)  # writes into k32/v32
    expected = dense_reference(tables, q.float(), k32, v32, window)
    write_kv(k_cache, v_cache, k, v, meta)
    tmeta = build_triton_metadata(tables, [s for s, _ in ROWS], [n for _, n in ROWS], q.device, BLOCK)
    got = triton_paged_attention(q, k_cache, v_cache, tmeta, window)
    torch.testing.assert_close(got.double(), expected, atol=tol, rtol=tol)


def _kernel_or_skip():
    from support.cpu_kernel import require_cpu_kernel

    require_cpu_kernel()


@pytest.mark.parametrize("isa", ["scalar", "avx2", "avx512"])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (4, 4), (8, 1)])
def test_cpu_kernel_equals_torch_path(isa, dtype, tol, window, heads, kv_heads):
    """The compiled kernel (each ISA variant this CPU runs) reads blocks in place; same answer
    as the torch path (and the dense one)."""
    from support.cpu_kernel import forced_isa

    with forced_isa(isa):
        _cpu_kernel_equals_torch_path(dtype, tol, window, heads, kv_heads)


def _cpu_kernel_equals_torch_path(dtype, tol, window, heads, kv_heads):
    tables, q, k, v, k_cache, v_cache = make_case(dtype, heads=heads, kv_heads=kv_heads)
    args = (tables, [s for s, _ in ROWS], [n for _, n in ROWS], NUM_DECODE, BLOCK, window,
            torch.device("cpu"))
    meta = build_attention_metadata(*args, pad_slot=PAD, cpu_kernel=True)
    # every row to the kernel: decodes, the chunk over a cached prefix and the fresh prompt
    assert meta.cpu is not None and not meta.decode_groups and not meta.prefills and not meta.fresh_groups
    assert meta.cpu.num_seqs == len(ROWS)
    write_kv(k_cache, v_cache, k, v, meta)
    got = paged_attention(q, k, v, k_cache, v_cache, meta)
    expected = paged_attention(q, k, v, k_cache, v_cache, build_attention_metadata(*args, pad_slot=PAD))
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), expected.float(), atol=tol, rtol=tol)
    dense = dense_reference(tables, q.float(), k_cache.float(), v_cache.float(), window)
    torch.testing.assert_close(got.double(), dense, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("isa", ["scalar", "avx2", "avx512"])
@pytest.mark.parametrize("head_dim", [40, 64, 144])
def test_cpu_kernel_long_chunks_span_many_tiles_and_blocks(dtype, tol, isa, head_dim):
    """Chunks longer than one query tile, head dims with and without a tail past whole vector
    blocks (40: 16 + 16 + 8; 64; 144: 64 + 64 + 16), q as a strided view, window on."""
    from support.cpu_kernel import forced_isa

    with forced_isa(isa):
        _long_chunks(dtype, tol, head_dim)


def _long_chunks(dtype, tol, head_dim):
    g = torch.Generator().manual_seed(1)
    heads, kv_heads, block = 6, 2, 8
    rows = [(37, 1), (130, 1), (50, 75), (3, 29)]  # (computed, new)
    blocks = iter(torch.randperm(200, generator=g).tolist())
    tables = [[next(blocks) for _ in range(-(-(s + n) // block))] for s, n in rows]
    total = sum(n for _, n in rows)
    qk = torch.randn(total, heads + kv_heads, head_dim, generator=g).to(dtype)
    q, k = qk[:, :heads], qk[:, heads:]
    v = torch.randn(total, kv_heads, head_dim, generator=g).to(dtype)
    for window in (None, 33):
        # 200 blocks and the zeroed pad slot after them
        k_cache = torch.randn(200 * block + 1, kv_heads, head_dim, generator=g).to(dtype)
        v_cache = torch.randn(200 * block + 1, kv_heads, head_dim, generator=g).to(dtype)
        k_cache[-1] = v_cache[-1] = 0
        args = (tables, [s for s, _ in rows], [n for _, n in rows], 2, block, window, torch.device("cpu"))
        meta = build_attention_metadata(*args, pad_slot=200 * block, cpu_kernel=True)
        write_kv(k_cache, v_cache, k, v, meta)
        got = paged_attention(q, k, v, k_cache, v_cache, meta)
        expected = paged_attention(q, k, v, k_cache, v_cache,
                                   build_attention_metadata(*args, pad_slot=200 * block))
        torch.testing.assert_close(got.float(), expected.float(), atol=tol, rtol=tol)
