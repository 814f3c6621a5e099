"""The weight-only path against a dequantize-then-matmul reference: unpacking and dequantizing
equal compressed-tensors' own ``unpack_from_int32`` + ``dequantize``, and the banded matmul
(a band of rows dequantized at a time) equals one matmul over the whole dequantized weight."""

from __future__ import annotations

import pytest
import torch

from loramux.engine.model.quant import base
from loramux.engine.model.quant.compressed_tensors import CompressedTensorsMethod, IntScheme
from loramux.engine.model.quant.int_packed import dequantize_int, unpack_int32


def library_quantized(out: int, k: int, bits: int, group: int | None, seed: int = 0,
                      symmetric: bool = True):
    """A random weight quantized and packed by compressed-tensors: (packed, scale, zero point
    (None when symmetric), its dequantized weight [out, k] by the library)."""
    from compressed_tensors.compressors.pack_quantized.helpers import (
        pack_to_int32,
        unpack_from_int32,
    )
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import dequantize, quantize
    from compressed_tensors.quantization.utils import calculate_qparams

    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out, k, generator=g)
    args = QuantizationArgs(num_bits=bits, type="int", symmetric=symmetric,
                            strategy="group" if group else "channel", group_size=group)
    view = w.unflatten(-1, (-1, group)) if group else w.unsqueeze(1)
    scale, zp = calculate_qparams(view.amin(-1), view.amax(-1), args)
    scale, zp = scale.reshape(out, -1), zp.reshape(out, -1)
    q = quantize(w, scale, zp, args, dtype=torch.int8)
    packed = pack_to_int32(q, bits)
    ref = dequantize(unpack_from_int32(packed, bits, torch.Size([out, k])), scale,
                     None if symmetric else zp, args)
    return packed, scale, None if symmetric else zp, ref


CASES = [(4, 32, 96), (4, 64, 128), (4, 128, 256), (4, None, 100), (8, None, 72), (8, 32, 64),
         (8, 128, 256)]


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("bits, group, k", CASES)
def test_dequantize_equals_the_library(bits, group, k, symmetric):
    packed, scale, zp, ref = library_quantized(48, k, bits, group, symmetric=symmetric)
    w = dequantize_int(unpack_int32(packed, bits, k), scale, group, zp)
    assert torch.equal(w, ref)


@pytest.mark.parametrize("bits", [4, 8])
def test_zero_points_unpack_as_the_library_packs_them(bits):
    """``weight_zero_point`` is packed along the output rows (the library's ``packed_dim=0``)."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    zp = torch.randint(-(1 << (bits - 1)), 1 << (bits - 1), (37, 3), dtype=torch.int8)
    method = CompressedTensorsMethod.__new__(CompressedTensorsMethod)
    got = method._zero_point("m.", pack_to_int32(zp, bits, packed_dim=0), IntScheme(bits, 32, False),
                             (37, 3))
    assert torch.equal(got, zp)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bits, group, k", CASES)
def test_banded_matmul_equals_dequantize_then_matmul(bits, group, k, dtype, monkeypatch):
    monkeypatch.setattr(base, "TILE_ELEMS", 7 * k)  # 7 rows a band: several bands, a ragged last
    packed, scale, _, ref = library_quantized(48, k, bits, group, seed=1)
    bias = torch.randn(48)
    layer = base.QuantLinear(CompressedTensorsMethod.__new__(CompressedTensorsMethod),
                             {"weight_packed": packed, "weight_scale": scale}, bias.to(dtype),
                             out_features=48, in_features=k, dtype=dtype, scheme=IntScheme(bits, group))
    x = torch.randn(5, k).to(dtype)
    y = layer(x)
    assert y.shape == (5, 48) and y.dtype == dtype
    want = torch.nn.functional.linear(x.to(layer.compute_dtype), ref.to(layer.compute_dtype),
                                      bias.to(dtype).to(layer.compute_dtype)).to(dtype)
    # bf16 bit for bit; float32 within rounding: the GEMM library may block (and so sum) a
    # 7-row band differently from the whole matrix, depending on the CPU
    tol = 0 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(y, want, rtol=tol, atol=tol)
    torch.testing.assert_close(layer.row_norms(), torch.linalg.vector_norm(ref, dim=1))
    a = torch.randn(3, k)
    torch.testing.assert_close(layer.project(a), a @ ref.T)
    # the bias is held in the compute dtype (float32 for bf16 on CPUs without native bf16)
    assert layer.nbytes == packed.numel() * 4 + scale.numel() * 4 + 48 * layer.compute_dtype.itemsize
