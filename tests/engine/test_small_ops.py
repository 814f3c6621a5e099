"""The fused small ops (``torch.ops.loramux``, ``csrc/fused_ops.c``) against the eager torch
ops they replace, under every ISA variant this CPU runs: bit-exact in bf16 (every rounding
where torch rounds), within an ulp in fp32; odd sizes (vector tails), strided rows,
non-finite values and the engine-level switch."""

from __future__ import annotations

import pytest
import torch
from support.cpu_kernel import ISAS, forced_isa, require_cpu_kernel

from loramux.engine.model.small_ops import EagerOps, FusedOps, select_small_ops

DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(autouse=True, params=ISAS)
def isa(request):
    """Every test once per ISA variant (skipped where this CPU cannot run it)."""
    with forced_isa(request.param):
        yield request.param


def ops_pair(dtype, act_dtype, positions=64, head_dim=8):
    require_cpu_kernel()
    g = torch.Generator().manual_seed(0)
    cos = torch.randn(positions, head_dim, generator=g).to(dtype)
    sin = torch.randn(positions, head_dim, generator=g).to(dtype)
    return EagerOps(cos, sin, 1e-5, dtype), FusedOps(cos, sin, 1e-5, act_dtype)


def assert_close(fused, eager, dtype):
    assert fused.shape == eager.shape
    if dtype == torch.bfloat16:  # the same roundings: equal, bar a rare last-bit norm tie
        mismatch = (fused.float() != eager.float()).float().mean().item()
        assert mismatch <= 1e-3, mismatch
        torch.testing.assert_close(fused.float(), eager.float(), rtol=8e-3, atol=0)
    else:
        torch.testing.assert_close(fused, eager, rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,hidden", [(1, 64), (5, 37), (40, 576), (3, 8)])
def test_add_rms_norm_matches_eager(dtype, rows, hidden):
    eager, fused = ops_pair(dtype, dtype)
    g = torch.Generator().manual_seed(rows * hidden)
    base = torch.randn(rows, hidden, generator=g).to(dtype)
    wide = torch.randn(rows, hidden + 3, generator=g).to(dtype)
    delta = wide[:, 1 : hidden + 1]  # a strided view: rows apart by hidden + 3
    weight = torch.randn(hidden, generator=g).to(dtype)
    r_eager, r_fused = base.clone(), base.clone()
    out_eager = eager.add_rms_norm(r_eager, delta, weight)
    out_fused = fused.add_rms_norm(r_fused, delta, weight)
    assert torch.equal(r_fused, r_eager)  # the residual add rounds exactly as torch's
    assert_close(out_fused, out_eager, dtype)
    assert_close(fused.add_rms_norm(r_fused, None, weight), eager.add_rms_norm(r_eager, None, weight), dtype)


def test_bf16_outputs_for_an_fp32_matmul_hold_the_bf16_values():
    eager, fused = ops_pair(torch.bfloat16, torch.float32)
    g = torch.Generator().manual_seed(1)
    res = torch.randn(7, 100, generator=g).to(torch.bfloat16)
    weight = torch.randn(100, generator=g).to(torch.bfloat16)
    gu = torch.randn(7, 2 * 50, generator=g).to(torch.bfloat16)
    out = fused.add_rms_norm(res.clone(), None, weight)
    assert out.dtype == torch.float32
    assert torch.equal(out, eager.add_rms_norm(res.clone(), None, weight).float())
    act = fused.silu_mul(gu)
    assert act.dtype == torch.float32 and torch.equal(act, eager.silu_mul(gu).float())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [8, 64, 6])
def test_rope_in_place_matches_eager(dtype, head_dim):
    eager, fused = ops_pair(dtype, dtype, positions=300, head_dim=head_dim)
    g = torch.Generator().manual_seed(head_dim)
    rows, heads, kv = 9, 5, 2
    qkv = torch.randn(rows, (heads + 2 * kv) * head_dim, generator=g).to(dtype)
    positions = torch.randint(0, 300, (rows,), generator=g)
    view = qkv[:, : (heads + kv) * head_dim].view(rows, heads + kv, head_dim)
    expected = eager.rope(view.clone(), eager.rope_state(positions))
    v_before = qkv[:, (heads + kv) * head_dim :].clone()
    got = fused.rope(view, fused.rope_state(positions))
    assert got.data_ptr() == view.data_ptr()  # rotated in place
    assert torch.equal(got, expected) if dtype == torch.bfloat16 else torch.allclose(got, expected, atol=1e-6)
    assert torch.equal(qkv[:, (heads + kv) * head_dim :], v_before)  # V untouched


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,inter", [(1, 16), (6, 19), (33, 1536)])
def test_silu_mul_matches_eager(dtype, rows, inter):
    eager, fused = ops_pair(dtype, dtype)
    g = torch.Generator().manual_seed(inter)
    gu = (torch.randn(rows, 2 * inter, generator=g) * 6).to(dtype)
    assert_close(fused.silu_mul(gu), eager.silu_mul(gu), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_non_finite_values_propagate(dtype):
    """An overflowed row stays non-finite (the engine's numeric isolation reads it) and
    leaves the other rows' results alone."""
    eager, fused = ops_pair(dtype, dtype)
    res = torch.ones(3, 16, dtype=dtype)
    delta = torch.zeros(3, 16, dtype=dtype)
    delta[1, 4] = float("inf")
    delta[2, 0] = float("nan")
    weight = torch.ones(16, dtype=dtype)
    out = fused.add_rms_norm(res, delta, weight)
    assert torch.isinf(res[1, 4]) and torch.isnan(res[2, 0])
    assert not torch.isfinite(out[1]).all() and not torch.isfinite(out[2]).all()
    assert torch.equal(out[0], eager.add_rms_norm(torch.ones(1, 16, dtype=dtype), None, weight)[0])
    gu = torch.zeros(2, 32, dtype=dtype)
    gu[1, 0] = float("nan")
    act = fused.silu_mul(gu)
    assert torch.isnan(act[1, 0]) and torch.equal(act[0], torch.zeros(16, dtype=dtype))


def test_selection_follows_enforce_eager_and_device():
    require_cpu_kernel()
    cos = sin = torch.zeros(4, 8)
    assert select_small_ops(cos, sin, 1e-5, torch.float32, enforce_eager=False).name == "fused"
    assert select_small_ops(cos, sin, 1e-5, torch.float32, enforce_eager=True).name == "eager"
    half = torch.zeros(4, 8, dtype=torch.float16)  # no fused kernel for fp16: eager
    assert select_small_ops(half, half, 1e-5, torch.float16, enforce_eager=False).name == "eager"
