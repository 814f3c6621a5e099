"""The compiled weight-only linear (``loramux::wq_linear``, csrc/wq_linear.c) against the
dequantize-then-matmul reference, in every ISA variant this CPU runs: int4 / int8, symmetric
and asymmetric, groups of 32 / 64 / 128 and per channel, 1 to 257 rows of x (the kernel's decode
tiles below its GEMM, which starts at 12 rows on AVX2 and 32 on AVX-512; the avx512bf16 variant's bf16 tiles and its bf16 bands
through oneDNN from 24 rows of bf16 x; the avx2 variant's fp32 bands through MKL from 256), odd output and
input sizes, fp32 and bf16 activations; its layout, its fake implementation, its refusals and
its wiring into the compressed-tensors layers (the torch path stays the fallback)."""

from __future__ import annotations

import pytest
import torch
from support.cpu_kernel import (
    ISAS,
    WQ_FP32_BAND_ROWS,
    forced_isa,
    require_cpu_kernel,
    wq_bf16_bands,
)

from loramux.engine.model.kernels import loader
from loramux.engine.model.kernels import ops as kernel_ops
from loramux.engine.model.quant import base
from loramux.engine.model.quant.compressed_tensors import CompressedTensorsMethod, IntScheme
from loramux.engine.model.quant.int_packed import (
    dequantize_int,
    fp8_kernel_layout,
    kernel_apply,
    kernel_dequantize,
    kernel_layout,
)

SHAPES = [(32, 96), (64, 128), (128, 256), (None, 100), (None, 67), (None, 32)]  # (group, K)
ROWS = (1, 2, 3, 11, 12, 17, 31, 32, 33, 64, WQ_FP32_BAND_ROWS + 1)  # from 12 / 32 rows: the kernel's GEMM


def quantized(n: int, k: int, bits: int, group: int | None, symmetric: bool, seed: int = 0):
    """Random signed values [n, k], float32 scales and int8 zero points (None when symmetric)."""
    g = torch.Generator().manual_seed(seed)
    lo = -(1 << (bits - 1))
    values = torch.randint(lo, -lo, (n, k), generator=g, dtype=torch.int32)
    groups = k // group if group else 1
    scale = torch.rand(n, groups, generator=g) * 0.05 + 0.005
    zp = None if symmetric else torch.randint(lo, -lo, (n, groups), generator=g).to(torch.int8)
    return values, scale, zp


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group, k", SHAPES)
def test_kernel_equals_dequantize_then_matmul(isa, bits, group, k, symmetric):
    # 64 x 261 x 256 is enough work to split over threads; 39 = two tiles of 16 and one of 7, which
    # the decode path takes as register tiles of 2, 2, 2 and 1 weight rows (AVX2 at one row of x:
    # 4 and 3), 38 ends in 6 (AVX2 at one row: 4 and 2), 261 in 5 (4 and 1)
    n = 261 if k == 256 else 38 if k == 96 else 39
    values, scale, zp = quantized(n, k, bits, group, symmetric)
    ref = dequantize_int(values, scale, group, zp)  # [n, k] float32
    params = kernel_layout(values, scale, zp, bits)
    assert torch.equal(kernel_dequantize(params, bits, k, group, 0, n), ref)
    bias = torch.randn(n)
    with forced_isa(isa):
        for m in ROWS:
            for dtype in (torch.float32, torch.bfloat16):
                x = torch.randn(m, k).to(dtype)
                y = kernel_apply(params, bits, k, group, x, bias if m % 2 else None, dtype)
                assert y.shape == (m, n) and y.dtype == dtype
                _close(y, x, ref, bias if m % 2 else None, dtype, m, isa)


def _close(y, x, w, bias, dtype, m, isa):
    """y against x @ w.T (+ bias): float32 x, the fp32 sums; bf16 x, one bf16 rounding of the fp32
    sum (the kernel, or fp32 bands), except where ``wq_bf16_bands``: there the band holds the
    weights a bf16 checkpoint holds (each rounded once) and the product is rounded to bf16 before
    the bias is added."""
    want = torch.nn.functional.linear(x.double(), w.double(), bias.double() if bias is not None else None)
    exact = (x.double().abs() @ w.double().abs().T).max().item()
    if dtype == torch.float32:
        torch.testing.assert_close(y.double(), want, rtol=0, atol=1e-5 * exact)
    elif not wq_bf16_bands(isa, m):
        torch.testing.assert_close(y.double(), want, rtol=2 ** -7, atol=1e-5 * exact)
    else:
        want = torch.nn.functional.linear(x.double(), w.to(torch.bfloat16).double(),
                                          bias.double() if bias is not None else None)
        torch.testing.assert_close(y.double(), want, rtol=2 ** -7, atol=2 ** -8 * exact)


@pytest.mark.parametrize("isa", ISAS)
def test_fp8_weights_widen_exactly(isa):
    """float8_e4m3fn weights: every byte but NaN (subnormals, zeros, both signs, the largest),
    odd input features (a padded last block), per-row scales; NaN bytes give NaN rows."""
    n, k = 39, 100
    g = torch.Generator().manual_seed(3)
    codes = torch.arange(256, dtype=torch.int32)
    codes = codes[(codes & 0x7F) != 0x7F]  # not NaN
    raw = codes[torch.randint(0, codes.numel(), (n, k), generator=g)].to(torch.uint8)
    raw[0, :codes.numel() % k] = codes[: codes.numel() % k].to(torch.uint8)
    weight = raw.view(torch.float8_e4m3fn)
    scale = torch.rand(n, 1, generator=g) * 0.05 + 0.005
    params = fp8_kernel_layout(weight, scale)
    ref = weight.float() * scale  # [n, k]: the library's rule in float32
    assert torch.equal(kernel_dequantize(params, 8, k, None, 0, n), ref)
    bias = torch.randn(n)
    with forced_isa(isa):
        for m in ROWS:
            for dtype in (torch.float32, torch.bfloat16):
                x = torch.randn(m, k).to(dtype)
                b = bias if m % 2 else None
                y = kernel_apply(params, 8, k, None, x, b, dtype)
                assert y.shape == (m, n) and y.dtype == dtype
                _close(y, x, ref, b, dtype, m, isa)
        nan = params["kernel_weight"].view(torch.uint8).clone()
        nan[5, 7] = 0x7F
        for m in (1, 40):
            for dtype in (torch.float32, torch.bfloat16):
                y = kernel_apply(dict(params, kernel_weight=nan.view(torch.float8_e4m3fn)), 8, k, None,
                                 torch.randn(m, k).to(dtype), None, dtype)
                assert torch.isnan(y[:, 5]).all() and not torch.isnan(y[:, 6]).any()


@pytest.mark.parametrize("isa", ISAS)
def test_strided_rows_and_empty_calls(isa):
    values, scale, zp = quantized(40, 64, 4, 32, False)
    params = kernel_layout(values, scale, zp, 4)
    x = torch.randn(5, 128)[:, ::2]  # not dense: copied first
    wide = torch.randn(3, 100)[:, :64]  # dense rows, a row stride of 100
    with forced_isa(isa):
        for xi in (x, wide):
            y = kernel_apply(params, 4, 64, 32, xi, None, torch.float32)
            want = xi @ dequantize_int(values, scale, 32, zp).T
            torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-4)
        assert kernel_apply(params, 4, 64, 32, torch.empty(0, 64), None, torch.float32).shape == (0, 40)


def test_int4_layout_interleaves_a_block_of_32():
    """Byte j of a block holds value j (low nibble) and value j + 16 (high), offset by 8."""
    values = torch.arange(32, dtype=torch.int32).view(1, 32) % 16 - 8  # u = k % 16
    w = kernel_layout(values, torch.ones(1, 1), None, 4)["kernel_weight"]
    assert w.shape == (1, 16) and w.dtype == torch.uint8
    assert w[0].tolist() == [j | (j << 4) for j in range(16)]


def test_refusals_and_fake():
    require_cpu_kernel()
    values, scale, _ = quantized(8, 64, 8, 32, True)
    p = kernel_layout(values, scale, None, 8)
    x = torch.randn(2, 64)
    with pytest.raises(ValueError, match="group_size must be 0"):
        kernel_ops.wq_linear(x, p["kernel_weight"], p["kernel_scale"], None, None, bits=8,
                             in_features=64, group_size=16, out_dtype=torch.float32)
    with pytest.raises(RuntimeError, match="scale must be"):
        kernel_ops.wq_linear(x, p["kernel_weight"], p["kernel_scale"][:, :1], None, None, bits=8,
                             in_features=64, group_size=32, out_dtype=torch.float32)
    with pytest.raises(RuntimeError, match="w must be"):
        kernel_ops.wq_linear(x, p["kernel_weight"][:, :32].contiguous(), p["kernel_scale"], None,
                             None, bits=8, in_features=64, group_size=32, out_dtype=torch.float32)
    meta = [t.to("meta") for t in (x, p["kernel_weight"], p["kernel_scale"])]
    y = kernel_ops.wq_linear(*meta, None, None, bits=8, in_features=64, group_size=32,
                             out_dtype=torch.bfloat16)
    assert y.shape == (2, 8) and y.dtype == torch.bfloat16 and y.device.type == "meta"


def _layer(bits: int, group: int | None, k: int, dtype: torch.dtype) -> base.QuantLinear:
    """A QuantLinear built by the method's load path (repacked for the kernel)."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    values, scale, _ = quantized(48, k, bits, group, True, seed=3)
    packed = pack_to_int32(values.to(torch.int8), bits)
    weights = {"type": "int", "num_bits": bits, "strategy": "group" if group else "channel",
               "group_size": group, "symmetric": True}
    method = CompressedTensorsMethod({"format": "pack-quantized", "config_groups": {
        "group_0": {"targets": ["Linear"], "weights": weights}}}, "test")
    assert method.scheme_of("m") == IntScheme(bits, group)
    tensors = {"m.weight_packed": packed, "m.weight_scale": scale,
               "m.weight_shape": torch.tensor([48, k])}
    bias = torch.randn(48).to(dtype)
    return method.create_linear(["m"], lambda name, *d: tensors.pop(name), bias, shapes=[(48, k)],
                                dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bits, group, k", [(4, 32, 96), (8, None, 72), (4, 16, 64)])
def test_layers_run_the_kernel_and_fall_back_to_torch(bits, group, k, dtype, monkeypatch):
    require_cpu_kernel()
    layer = _layer(bits, group, k, dtype)
    fits = group is None or group % 32 == 0
    assert ("kernel_weight" in layer.params) == fits  # group 16: the checkpoint layout, torch path
    x = torch.randn(5, k).to(dtype)
    y = layer(x)
    monkeypatch.setattr(loader, "available", lambda: False)
    torch_y = layer(x)  # the reference: bands dequantized (from the kernel layout), matmul
    assert y.dtype == torch_y.dtype == dtype
    w = torch.cat([band for _, _, band in layer.bands()]).double()  # [48, k]
    want = x.double() @ w.T + layer.bias.double()
    exact = (x.double().abs() @ w.abs().T).max().item()
    if dtype == torch.float32:
        for got in (y, torch_y):
            torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-5 * exact)
    else:  # the kernel rounds its fp32 sum once; a bf16 matmul rounds its operands too
        torch.testing.assert_close(y.double(), want, rtol=2 ** -7,
                                   atol=(1e-5 if fits else 2 ** -7) * exact)
        torch.testing.assert_close(torch_y.double(), want, rtol=2 ** -7, atol=2 ** -7 * exact)


def test_float16_activations_run_the_torch_path():
    """The kernel takes float32 / bfloat16; a float16 layer keeps the torch path."""
    require_cpu_kernel()
    layer = _layer(4, 32, 64, torch.float16)
    x = torch.randn(3, 64).to(torch.float16)
    y = layer(x)
    w = torch.cat([band for _, _, band in layer.bands()]).double()
    want = x.double() @ w.T + layer.bias.double()
    assert y.dtype == torch.float16
    torch.testing.assert_close(y.double(), want, rtol=1e-2, atol=1e-2 * want.abs().max().item())
