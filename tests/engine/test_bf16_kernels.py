"""The native-bf16 CPU kernels (the ``avx512bf16`` ISA variant: VDPBF16PS) against fp32
references, and the variant's selection by the CPU's flags.

The bf16 paths multiply bf16 pairs exactly (a bf16 x bf16 product fits in fp32) and sum in
fp32, in another order than the fp32-FMA paths: results are close to those, not bit-identical,
so each test bounds the difference by what its inputs justify (fp32 summation error, and the
one bf16 rounding of the SGMV's intermediate that a torch bf16 ``(x @ A.T) @ B`` has as well).
On a CPU without AVX512_BF16 the variant must not run: the tests of its paths skip (saying so),
and the selection test checks that the fallback (the best other variant) is chosen.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from support.cpu_kernel import forced_isa, require_cpu_kernel, wq_bf16_bands

from loramux.engine.model.kernels import loader

BF16 = "avx512bf16"
U = 2.0**-24  # fp32 unit roundoff


def cpu_has_bf16() -> bool:
    try:
        return "avx512_bf16" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


def test_bf16_variant_runs_only_where_the_cpu_has_it():
    """``avx512bf16`` is the first choice where the CPU reports avx512_bf16; elsewhere it never
    runs and ``auto`` falls back to the best other variant (setup.py leaves it out of a build
    whose compiler cannot build it: then it is unknown)."""
    require_cpu_kernel()
    runs = loader.isas()
    if BF16 in runs:
        assert cpu_has_bf16() and runs[0] == BF16 and loader.select_isa("auto") == BF16
        return
    with pytest.raises(ValueError, match="cannot run|unknown ISA") as refused:
        loader.select_isa(BF16)
    if cpu_has_bf16() and "avx512" in runs:  # this CPU runs it: only a build without it explains
        assert "unknown ISA" in str(refused.value)
    assert loader.select_isa("auto") == runs[0] != BF16


def _sgmv_inputs(S, R, K, widths, ranks, runs, T, seed=0):
    g = torch.Generator().manual_seed(seed)
    N = sum(widths)
    offs = [0]
    for w in widths:
        offs.append(offs[-1] + w)
    slots = len(ranks)
    a = torch.full((slots, S, R, K), float("nan"))  # rows past a rank are never read
    b = torch.full((slots, S * R, N), float("nan"))
    for slot, r in enumerate(ranks):
        a[slot, :, :r] = torch.randn(S, r, K, generator=g) * 0.1
        b[slot, :, :] = 0
        for s in range(S):
            b[slot, s * R : s * R + r, offs[s] : offs[s + 1]] = torch.randn(r, widths[s], generator=g) * 0.1
    for slot, r in enumerate(ranks):
        for s in range(S):
            b[slot, s * R + r : (s + 1) * R] = float("nan")
    x = torch.randn(T, K, generator=g).bfloat16()
    return x, a.bfloat16(), b.bfloat16(), torch.tensor(runs), torch.tensor(ranks), torch.tensor(offs)


@pytest.mark.parametrize("case", [
    # S, R, K, slice widths, slot ranks, runs (start, end, slot), tokens
    (3, 16, 576, (576, 192, 192), [16, 8, 16, 12], [(0, 4, 0), (4, 8, 1), (8, 12, 2), (12, 16, 3)], 16),  # qkv decode
    (2, 32, 576, (1536, 1536), [32], [(0, 64, 0)], 64),  # gate_up prefill chunk
    # prompt runs split over threads, expand blocks of 12 tokens and groups of 4 with remainders
    (2, 32, 576, (1536, 1536), [16, 9], [(0, 37, 0), (37, 40, 1), (41, 70, 0)], 72),
    (1, 8, 1536, (576,), [8, 5], [(0, 7, 1), (9, 12, 0)], 12),  # down, odd rank, base rows 7-8
    (3, 8, 45, (50, 40, 61), [7, 3, 8], [(0, 1, 2), (1, 4, 0), (6, 7, 1), (7, 13, 2)], 13),  # off the widths
])
def test_sgmv_bf16_path_against_fp32_reference(case):
    """``lora_sgmv`` in the bf16 variant, bf16 x and slots, fp32 y: each run's
    ``(x @ A.T) @ B`` in float64 with the intermediate rounded to bf16 (as the kernel and torch's
    bf16 matmuls round it). Bound: the shrink's fp32 sums can round v to the bf16 next to the
    reference's (one bf16 ulp, 2**-8 relative), plus fp32 summation of both dot products."""
    S, R, K, widths, ranks, runs, T = case
    x, a, b, runs_t, ranks_t, offs = _sgmv_inputs(S, R, K, widths, ranks, runs, T)
    y0 = torch.randn(T, sum(widths), generator=torch.Generator().manual_seed(1))
    with forced_isa(BF16):
        y = y0.clone()
        torch.ops.loramux.lora_sgmv(y, x, a, b, runs_t, ranks_t, offs)
    want, bound = y0.double().clone(), torch.zeros_like(y0, dtype=torch.float64)
    for start, end, slot in runs:
        r = ranks[slot]
        for s in range(S):
            ar = a[slot, s, :r].double()
            br = b[slot, s * R : s * R + r, offs[s] : offs[s + 1]].double()
            xv = x[start:end].double()
            v = xv @ ar.T
            vb = v.to(torch.bfloat16).double()
            want[start:end, offs[s] : offs[s + 1]] += vb @ br
            vmag = xv.abs() @ ar.abs().T
            bound[start:end, offs[s] : offs[s + 1]] += ((2**-8 * vb.abs() + 2 * K * U * vmag) @ br.abs()
                                                        + 2 * r * U * (vb.abs() @ br.abs()))
    err = (y.double() - want).abs()
    assert torch.all(err <= bound + 1e-6), float((err - bound).max())
    base = [t for t in range(T) if not any(s <= t < e for s, e, _ in runs)]
    assert torch.equal(y[base], y0[base])


def test_sgmv_bf16_path_close_to_fp32_fma_path():
    """The bf16 and fp32-FMA variants on the same bf16 qkv decode call with a bf16 y: within one
    bf16 rounding of y plus the intermediate's (bit-exactness is not expected)."""
    x, a, b, runs, ranks, offs = _sgmv_inputs(3, 16, 576, (576, 192, 192), [16, 16],
                                              [(0, 5, 0), (5, 9, 1)], 9, seed=3)
    y0 = torch.randn(9, 960, generator=torch.Generator().manual_seed(4)).bfloat16()
    out = {}
    for isa in ("avx512", BF16):
        with forced_isa(isa):
            out[isa] = y0.clone()
            torch.ops.loramux.lora_sgmv(out[isa], x, a, b, runs, ranks, offs)
    torch.testing.assert_close(out[BF16].float(), out["avx512"].float(), rtol=2**-6, atol=2e-2)
    assert not torch.equal(out[BF16].float() - y0.float(), torch.zeros(9, 960))


def _pack(values: torch.Tensor, bits: int) -> torch.Tensor:
    """[N, K] signed values -> the wq kernel's layout (wq_linear.c), Kp = K rounded up to 32."""
    n, k = values.shape
    kp = (k + 31) // 32 * 32
    padded = torch.zeros(n, kp, dtype=torch.int32)
    padded[:, :k] = values
    if bits == 8:
        return padded.to(torch.int8).view(torch.uint8)
    u = (padded + 8).view(n, kp // 32, 32)
    return (u[..., :16] | (u[..., 16:] << 4)).to(torch.uint8).reshape(n, kp // 2)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group, k", [(64, 576), (128, 1536), (32, 96), (96, 576), (0, 576), (0, 608), (0, 100)])
@pytest.mark.parametrize("symmetric", [True, False])
def test_wq_bf16_path_against_fp32_reference(bits, group, k, symmetric):
    """``wq_linear`` in the bf16 variant, bf16 x (1 to 31 rows: the decode path for an fp32 y, and
    for a bf16 y below 24 rows; 33 and 64: the kernel's float32 GEMM for an fp32 y; from 24 rows
    with a bf16 y, bands of W rounded to bf16 through oneDNN, against the same rounded weights,
    the product rounded to bf16 before the bias),
    fp32 and bf16 y, against float64 ``x @ dequant(W).T``. Groups of two blocks and lone blocks (96 = 64 + 32,
    K = 608 per channel) exercise both of the int4 repacked orders. Bound: fp32 summation of
    the sums the kernel forms (int4's through the exact offset of 128, taken off again with
    the zero point), K * 2**-24 relative to their magnitudes; a bf16 y adds one rounding."""
    g = torch.Generator().manual_seed(bits * 1000 + k + group)
    n = 37
    lo = -(1 << (bits - 1))
    q = torch.randint(lo, -lo, (n, k), generator=g, dtype=torch.int32)
    groups = k // group if group else 1
    scale = torch.rand(n, groups, generator=g) * 0.05 + 0.005
    zp = None if symmetric else torch.randint(lo, -lo, (n, groups), generator=g).float()
    gs = group or k
    zero_stored = (zp if zp is not None else torch.zeros(n, groups)) + (8 if bits == 4 else 0)
    deq = (q.double() - (zp if zp is not None else torch.zeros(n, groups)).double().repeat_interleave(gs, 1)) \
        * scale.double().repeat_interleave(gs, 1)
    w = _pack(q, bits)
    bias = torch.randn(n, generator=g)
    off = 128 + 8 if bits == 4 else 0
    mag_w = (q.double().abs() + zero_stored.double().abs().repeat_interleave(gs, 1) + off) \
        * scale.double().repeat_interleave(gs, 1)
    with forced_isa(BF16):
        for m in (1, 3, 4, 5, 11, 12, 17, 23, 24, 31, 33, 64):
            x = torch.randn(m, k, generator=g).bfloat16()
            want = x.double() @ deq.T + bias.double()
            bound = 4 * k * U * (x.double().abs() @ mag_w.T) + 1e-6
            for out_dtype in (torch.float32, torch.bfloat16):
                y = torch.ops.loramux.wq_linear(x, w, scale, zero_stored if not symmetric else None, bias, bits,
                                                k, group, out_dtype)
                if wq_bf16_bands(BF16, m) and out_dtype == torch.bfloat16:  # the oneDNN band path
                    w_b = deq.float().bfloat16().double()  # (q - zero) * scale in fp32, rounded once
                    want_b = x.double() @ w_b.T + bias.double()
                    mag = x.double().abs() @ w_b.abs().T
                    err, limit = (y.double() - want_b).abs(), 4 * k * U * mag + 2**-8 * (mag + want_b.abs())
                else:
                    err = (y.double() - want).abs()
                    limit = bound + (2**-8 * want.abs() if out_dtype == torch.bfloat16 else 0)
                assert torch.all(err <= limit), (m, out_dtype, float((err - limit).max()))


@pytest.mark.parametrize("D, window, softcap, H, Hkv", [
    (64, 0, 0.0, 9, 3), (48, 40, 0.0, 9, 3), (64, 0, 30.0, 9, 3),
    (64, 0, 0.0, 14, 2), (80, 0, 0.0, 10, 2), (64, 20, 0.0, 4, 4), (128, 0, 0.0, 8, 2)])
def test_attention_bf16_decode_scores_against_fp64(D, window, softcap, H, Hkv):
    """``paged_attention`` in the bf16 variant on a bf16 cache, decode rows (the per-row path;
    GQA groups of 1 to 7 query heads, which share each value row's load: 7 = a pass of 4 heads
    and one of 3): scores by VDPBF16PS on q and the keys where they lie,
    against float64 attention on the same bf16 values, and close to the fp32-FMA variant. The
    scores differ from exact sums by fp32 summation only (D * 2**-24 relative); the output
    rounds once to bf16, so one bf16 ulp (2**-8 relative) bounds the difference."""
    g = torch.Generator().manual_seed(D + window + H)
    bs, ctx = 16, [1, 37, 130, 64]
    nseq = len(ctx)
    width = max((c + bs - 1) // bs for c in ctx)
    perm = torch.randperm(nseq * width, generator=g).int()
    tables = perm.view(nseq, width).contiguous()
    k_cache = torch.randn(nseq * width * bs, Hkv, D, generator=g).bfloat16()
    v_cache = torch.randn(nseq * width * bs, Hkv, D, generator=g).bfloat16()
    q = torch.randn(nseq, H, D, generator=g).bfloat16()
    scale = D**-0.5
    args = (tables, torch.arange(nseq).int(), torch.ones(nseq).int(), torch.tensor(ctx).int(), bs, scale,
            window, softcap)
    out = {}
    for isa in ("avx512", BF16):
        with forced_isa(isa):
            out[isa] = torch.zeros(nseq, H * D, dtype=torch.bfloat16)
            torch.ops.loramux.paged_attention(q, k_cache, v_cache, out[isa], *args)
    want = torch.zeros(nseq, H * D, dtype=torch.float64)
    for s, c in enumerate(ctx):
        pos = torch.arange(c)
        slots = (tables[s][pos // bs].long() * bs + pos % bs)
        if window:
            slots = slots[max(0, c - window):]
        keys = k_cache[slots].double().repeat_interleave(H // Hkv, 1)  # [n, H, D]
        vals = v_cache[slots].double().repeat_interleave(H // Hkv, 1)
        sc = torch.einsum("hd,nhd->hn", q[s].double(), keys) * scale
        if softcap:
            sc = softcap * torch.tanh(sc / softcap)
        want[s] = torch.einsum("hn,nhd->hd", torch.softmax(sc, -1), vals).reshape(-1)
    torch.testing.assert_close(out[BF16].double(), want, rtol=2**-7, atol=2e-3)
    torch.testing.assert_close(out[BF16].float(), out["avx512"].float(), rtol=2**-7, atol=2e-3)


@pytest.mark.parametrize("D, window, softcap, H, Hkv", [
    (64, 0, 0.0, 9, 3), (48, 40, 0.0, 9, 3), (64, 0, 30.0, 9, 3), (64, 0, 0.0, 14, 2),
    (80, 0, 0.0, 10, 2), (33, 0, 0.0, 4, 4), (128, 20, 0.0, 8, 2)])
def test_attention_bf16_prompt_tiles_against_fp64(D, window, softcap, H, Hkv):
    """Prompt rows (tiles of 8+ query vectors) in the bf16 variant on a bf16 cache: q . k and
    p . v by VDPBF16PS on packed key / value pairs, fresh prompts and chunks over a cached
    prefix, beside decode rows, against float64 attention on the same bf16 values. The bound:
    one bf16 rounding of the output (2**-8 relative) plus p rounded to bf16 before p . v
    (2**-8 of sum_j p_j |v_j|), and fp32 score sums."""
    g = torch.Generator().manual_seed(D + window + H)
    bs = 16
    rows = [(0, 1), (0, 150), (37, 1), (45, 70), (0, 9), (130, 3)]  # (computed, new)
    nseq = len(rows)
    ctx = [c + n for c, n in rows]
    width = max((c + bs - 1) // bs for c in ctx)
    tables = torch.randperm(nseq * width, generator=g).int().view(nseq, width).contiguous()
    k_cache = torch.randn(nseq * width * bs, Hkv, D, generator=g).bfloat16()
    v_cache = torch.randn(nseq * width * bs, Hkv, D, generator=g).bfloat16()
    starts = torch.tensor([0] + [n for _, n in rows[:-1]]).cumsum(0).int()
    q = torch.randn(int(sum(n for _, n in rows)), H, D, generator=g).bfloat16()
    scale = D**-0.5
    args = (tables, starts, torch.tensor([n for _, n in rows]).int(), torch.tensor(ctx).int(), bs, scale,
            window, softcap)
    out = {}
    for isa in ("avx512", BF16):
        with forced_isa(isa):
            out[isa] = torch.zeros(q.shape[0], H * D, dtype=torch.bfloat16)
            torch.ops.loramux.paged_attention(q, k_cache, v_cache, out[isa], *args)
    want = torch.zeros(q.shape[0], H, D, dtype=torch.float64)
    pv_mag = torch.zeros_like(want)
    for s, (done, n) in enumerate(rows):
        pos = torch.arange(ctx[s])
        slots = tables[s][pos // bs].long() * bs + pos % bs
        keys = k_cache[slots].double().repeat_interleave(H // Hkv, 1)  # [ctx, H, D]
        vals = v_cache[slots].double().repeat_interleave(H // Hkv, 1)
        qs = q[int(starts[s]): int(starts[s]) + n].double()  # [n, H, D]
        sc = torch.einsum("nhd,chd->hnc", qs, keys) * scale
        if softcap:
            sc = softcap * torch.tanh(sc / softcap)
        qpos = torch.arange(done, done + n)[:, None]
        visible = pos[None, :] <= qpos
        if window:
            visible &= pos[None, :] > qpos - window
        p = torch.softmax(sc.masked_fill(~visible, float("-inf")), -1)
        want[int(starts[s]): int(starts[s]) + n] = torch.einsum("hnc,chd->nhd", p, vals)
        pv_mag[int(starts[s]): int(starts[s]) + n] = torch.einsum("hnc,chd->nhd", p, vals.abs())
    want, pv_mag = want.reshape(q.shape[0], -1), pv_mag.reshape(q.shape[0], -1)
    bound = 2**-8 * (want.abs() + pv_mag) + 1e-4
    err = (out[BF16].double() - want).abs()
    assert (err <= bound).all(), f"worst excess {(err - bound).max().item():.3g}"
    torch.testing.assert_close(out[BF16].float(), out["avx512"].float(), rtol=2**-7, atol=2e-2)
