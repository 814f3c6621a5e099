"""The Triton weight-only GEMM (``engine/model/quant/triton_wq.py``, the CUDA path of int4 / int8
weights) against the dequantize-then-matmul reference in float32, under ``TRITON_INTERPRET=1``
on the CPU (fp32 / fp16 activations; the interpreter gets bf16 ``tl.dot`` wrong): decode (1-8
rows) and prefill (64 rows) shapes, int4 / int8, symmetric / asymmetric, per channel and groups
of 32 / 64 / 128, input and output sizes that are no multiple of the tiles, split K; its layout
made from compressed-tensors' and the CPU kernel's tensors (GPTQ's column order too), and the
layers' dispatch to it."""

from __future__ import annotations

import pytest
import torch

from loramux.engine.model.quant import triton_wq
from loramux.engine.model.quant.base import QuantLinear
from loramux.engine.model.quant.compressed_tensors import CompressedTensorsMethod, IntScheme
from loramux.engine.model.quant.int_packed import dequantize_int, kernel_layout
from loramux.engine.model.quant.repacked import ModulePart, RepackedMethod, repack

pytestmark = pytest.mark.skipif(not triton_wq.HAS_TRITON, reason="triton is not installed")

N = 80  # output features: one full and one partial 64-column tile


def quantized(n: int, k: int, bits: int, group: int | None, symmetric: bool, seed: int = 0):
    """Random signed values [n, k] int32, float32 scales [n, G], int8 zero points or None."""
    g = torch.Generator().manual_seed(seed)
    lo = -(1 << (bits - 1))
    values = torch.randint(lo, -lo, (n, k), generator=g, dtype=torch.int32)
    groups = k // group if group else 1
    scale = torch.rand(n, groups, generator=g) * 0.05 + 0.005
    zp = None if symmetric else torch.randint(lo, -lo, (n, groups), generator=g).to(torch.int8)
    return values, scale, zp


def ct_packed(values: torch.Tensor, bits: int) -> torch.Tensor:
    """compressed-tensors' ``weight_packed``: unsigned values, ``32 / bits`` to an int32 word,
    the first in the lowest bits, the last word zero-padded."""
    n, k = values.shape
    per = 32 // bits
    u = torch.zeros(n, -(-k // per) * per, dtype=torch.int64)
    u[:, :k] = values + (1 << (bits - 1))
    words = (u.view(n, -1, per) << (torch.arange(per) * bits)).sum(-1)  # [n, words] < 2^32
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def _check(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> None:
    want = x.double() @ w.double().T + (bias.double() if bias is not None else 0)
    scale = (x.double().abs() @ w.double().abs().T).max().item()  # the sums' magnitude
    tol = 2e-6 if x.dtype == torch.float32 else 2e-3
    assert y.dtype == x.dtype and y.shape == want.shape
    torch.testing.assert_close(y.double(), want, rtol=0, atol=tol * scale)


CASES = [  # (bits, group, K, symmetric)
    (4, None, 201, True), (4, 32, 96, False), (4, 64, 192, True), (4, 128, 256, False),
    (8, None, 100, False), (8, 32, 160, True), (8, 64, 64, False), (8, 128, 384, True),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("bits, group, k, symmetric", CASES)
def test_kernel_equals_dequantize_then_matmul(bits, group, k, symmetric, dtype):
    values, scale, zp = quantized(N, k, bits, group, symmetric, seed=k)
    w = dequantize_int(values, scale, group, zp)  # [N, k] float32, the reference weight
    layout = triton_wq.pack(values, scale, zp, bits, group)
    g = torch.Generator().manual_seed(1)
    bias = torch.randn(N, generator=g)
    for m in (1, 3, 8, 64, triton_wq.DENSE_ROWS + 3):  # the last: dequantize, torch matmul
        x = torch.randn(m, k, generator=g).to(dtype)
        b = bias.to(dtype) if m % 2 else None
        _check(triton_wq.wq_matmul(x, layout, bits, group, b), x, w,
               b.float() if b is not None else None)


@pytest.mark.parametrize("bits, group", [(4, 32), (8, None)])
def test_split_k_sums_the_partials(bits, group):
    k = 320
    values, scale, zp = quantized(N, k, bits, group, False, seed=3)
    w = dequantize_int(values, scale, group, zp)
    layout = triton_wq.pack(values, scale, zp, bits, group)
    x, bias = torch.randn(5, k), torch.randn(N)
    for split in (1, 2, 3, 64):  # 64: more splits than tiles
        _check(triton_wq.wq_matmul(x, layout, bits, group, bias, split_k=split), x, w, bias)


@pytest.mark.parametrize("bits, group, symmetric", [(4, 32, False), (8, None, True), (4, None, False)])
def test_dequantize_t_is_the_reference_weight(bits, group, symmetric):
    k = 96
    values, scale, zp = quantized(N, k, bits, group, symmetric, seed=5)
    layout = triton_wq.pack(values, scale, zp, bits, group)
    w = triton_wq.dequantize_t(layout, bits, group, k, torch.float32)  # [k, N]
    torch.testing.assert_close(w, dequantize_int(values, scale, group, zp).T, rtol=0, atol=0)


def test_fits_and_refused_groups():
    assert triton_wq.fits(None) and triton_wq.fits(32) and triton_wq.fits(96)
    assert triton_wq.fits(48, bits=8) and not triton_wq.fits(48) and not triton_wq.fits(8, bits=8)
    params = {"weight_packed": ct_packed(torch.zeros(4, 48, dtype=torch.int32), 4),
              "weight_scale": torch.ones(4, 2)}
    assert triton_wq.make_layout(params, 4, 24, 48) is None
    assert triton_wq.make_layout({"weight": torch.ones(4, 4)}, 8, None, 4) is None  # FP8


def _ct_layer(bits, group, k, symmetric, dtype=torch.float32, stored="ct"):
    qc = {"config_groups": {"g": {"targets": ["Linear"], "format": "pack-quantized", "weights": {
        "type": "int", "num_bits": bits, "strategy": "group" if group else "channel",
        "group_size": group, "symmetric": symmetric}}}}
    values, scale, zp = quantized(N, k, bits, group, symmetric, seed=7)
    if stored == "ct":
        params = {"weight_packed": ct_packed(values, bits), "weight_scale": scale}
        if zp is not None:
            params["weight_zero_point"] = zp
    else:
        params = kernel_layout(values, scale, zp, bits)
    layer = QuantLinear(CompressedTensorsMethod(qc, "test"), params, torch.randn(N), out_features=N,
                        in_features=k, dtype=dtype, scheme=IntScheme(bits, group, symmetric))
    return layer, dequantize_int(values, scale, group, zp)


@pytest.mark.parametrize("stored", ["ct", "kernel"])
@pytest.mark.parametrize("bits, group, k, symmetric", [(4, 64, 128, False), (8, None, 72, True)])
def test_layer_converted_at_load_runs_the_kernel(bits, group, k, symmetric, stored):
    layer, w = _ct_layer(bits, group, k, symmetric, stored=stored)
    before = layer.nbytes
    assert triton_wq.prepare(layer)  # what a CUDA layer does when it is made
    assert set(layer.params) <= {"wq_weight", "wq_scale", "wq_zero"}
    assert layer.nbytes <= before + N * 4  # the same integers, never a float copy
    torch.testing.assert_close(torch.cat([b for _, _, b in layer.bands(rows=24)]), w)
    torch.testing.assert_close(layer.row_norms(), torch.linalg.vector_norm(w, dim=1))
    x = torch.randn(3, k)
    _check(layer(x), x, w, layer.bias)  # CompressedTensorsMethod.apply → the kernel


class _Repacked(RepackedMethod):
    name = "test"

    def create_linear(self, *args, **kwargs):  # pragma: no cover - not loaded from a folder
        raise NotImplementedError


def test_activation_order_parts_gather_the_columns():
    k, group, bits = 128, 32, 4
    parts, ws = [], []
    for i, shuffle in enumerate((True, False, True)):
        values, scale, _ = quantized(24, k, bits, group, True, seed=10 + i)
        perm = torch.randperm(k, generator=torch.Generator().manual_seed(i)) if shuffle else None
        # the kernel's column j is the checkpoint's column perm[j]
        w = dequantize_int(values, scale, group)  # in the kernel's (sorted) column order
        full = torch.empty_like(w)
        full[:, perm if perm is not None else torch.arange(k)] = w
        ws.append(full)
        unsigned = values + (1 << (bits - 1))
        parts.append(ModulePart(lambda r0, r1, u=unsigned, p=perm: u[r0:r1][:, torch.argsort(p)]
                                if p is not None else u[r0:r1], 24, k, scale, None, perm))
    params, scheme = repack(parts, bits, group, torch.device("cpu"))
    layer = QuantLinear(_Repacked(), params, None, out_features=72, in_features=k,
                        dtype=torch.float16, scheme=scheme)
    w = torch.cat(ws)
    torch.testing.assert_close(torch.cat([b for _, _, b in layer.bands()]), w)
    assert triton_wq.prepare(layer) and "perm" in layer.params
    torch.testing.assert_close(torch.cat([b for _, _, b in layer.bands()]), w)
    x = torch.randn(4, k).to(torch.float16)  # fp16: the CPU kernel never takes it
    _check(layer(x), x, w, None)


@pytest.mark.parametrize("bits", [4, 8])
def test_a_regrouped_tensor_parallel_share_runs_padded_groups(bits):
    """A rank's share of an activation-order layer (``repacked.regroup``): its 96 columns draw
    on all 8 groups of 32, each group's run padded to whole sub-groups; the Triton layout keeps
    the kernel's wider columns and gathers the activations by ``perm`` (padding: exact zeros)."""
    from loramux.engine.model.quant.repacked import regroup

    n, k_all, group, k = 40, 256, 32, 96
    gen = torch.Generator().manual_seed(3)
    g_all = torch.randperm(k_all, generator=gen) // group  # act order: column c in group g_all[c]
    g_idx = g_all[:k]  # this rank's share: columns 0..95
    values = torch.randint(0, 1 << bits, (n, k), generator=gen, dtype=torch.int32)  # unsigned
    scale = torch.rand(n, k_all // group, generator=gen) * 0.05 + 0.005
    zero = torch.randint(0, 1 << bits, (n, k_all // group), generator=gen, dtype=torch.int32)
    w = (values - zero[:, g_idx]).float() * scale[:, g_idx]  # [n, k] the share's weights
    part = regroup(lambda r0, r1: values[r0:r1], n, k, scale, zero, g_idx, group, bits)
    params, scheme = repack([part], bits, part.group_size, torch.device("cpu"))
    layer = QuantLinear(_Repacked(), params, None, out_features=n, in_features=k,
                        dtype=torch.float16, scheme=scheme)
    assert layer.kernel_in_features > k and layer.kernel_in_features % part.group_size == 0
    torch.testing.assert_close(torch.cat([b for _, _, b in layer.bands()]), w)
    assert triton_wq.prepare(layer) and "perm" in layer.params
    torch.testing.assert_close(torch.cat([b for _, _, b in layer.bands()]), w)
    x = torch.randn(4, k).to(torch.float16)
    _check(layer(x), x, w, None)
