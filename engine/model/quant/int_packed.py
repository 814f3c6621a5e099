"""Integer weights packed into int32 words, as compressed-tensors' ``pack-quantized`` format
writes them: each row's values (offset to unsigned by ``2^(bits-1)``) packed along the input
dimension, ``32 / bits`` to a word, the first value in the lowest bits; a row's last word is
padded with zeros. 4 and 8 bits (no value straddles a word)."""

from __future__ import annotations

import torch

PACKED_BITS = (4, 8)
"""Widths whose values never straddle a word."""


def packed_columns(in_features: int, num_bits: int) -> int:
    """Words per row for ``in_features`` values of ``num_bits`` bits."""
    return -(-in_features * num_bits // 32)


def unpack_int32(packed: torch.Tensor, num_bits: int, in_features: int) -> torch.Tensor:
    """The signed values of ``packed`` [n, words] int32: [n, in_features] int32 in
    ``[-2^(bits-1), 2^(bits-1))``."""
    per_word = 32 // num_bits
    shifts = torch.arange(0, 32, num_bits, dtype=torch.int32, device=packed.device)  # [per_word]
    values = (packed.unsqueeze(-1) >> shifts) & ((1 << num_bits) - 1)  # [n, words, per_word]
    values = values.view(packed.shape[0], packed.shape[1] * per_word)[:, :in_features]
    return values - (1 << (num_bits - 1))


def dequantize_int(values: torch.Tensor, scale: torch.Tensor, group_size: int | None,
                   zero_point: torch.Tensor | None = None) -> torch.Tensor:
    """``(values - zero_point) * scale`` in the scale's dtype, as compressed-tensors computes it:
    values [n, in] integers; scale and zero_point [n, 1] per channel or [n, in / group_size]
    per group. Returns [n, in]."""
    n, k = values.shape
    w = values.to(scale.dtype)  # [n, in]
    if group_size is not None:
        w = w.view(n, k // group_size, group_size)  # [n, G, g]
        scale = scale.unsqueeze(-1)  # [n, G, 1]
        zero_point = zero_point.unsqueeze(-1) if zero_point is not None else None
    if zero_point is not None:
        w = w - zero_point.to(scale.dtype)
    return (w * scale).view(n, k)


# ---- the compiled kernel's layout (csrc/wq_linear.c) ------------------------------------------

KERNEL_BLOCK = 32
"""Values per block of the kernel's layout: a row holds ``in_features`` rounded up to it."""
KERNEL_KEYS = ("kernel_weight", "kernel_scale", "kernel_zero")
"""A layer's tensors in the kernel's layout (``kernel_zero`` only when asymmetric)."""


def kernel_fits(group_size: int | None) -> bool:
    """Whether the kernel runs this grouping: per channel, or groups of whole blocks."""
    return group_size is None or group_size % KERNEL_BLOCK == 0


def kernel_layout(values: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None,
                  num_bits: int) -> dict[str, torch.Tensor]:
    """Signed values [n, in] (``unpack_int32``), scale [n, G] and zero point [n, G] (or None)
    in the kernel's layout, built once at load: ``kernel_weight`` uint8 [n, kp·bits/8] (kp =
    in rounded up to 32; int8: the signed bytes; int4: per block of 32, byte j = u[j] |
    u[j+16] << 4 with u = value + 8), ``kernel_scale`` float32 [n, G] and ``kernel_zero``
    float32 [n, G], the stored value's offset (int4: zero point + 8), when asymmetric."""
    n, k = values.shape
    kp = -(-k // KERNEL_BLOCK) * KERNEL_BLOCK
    offset = 8 if num_bits == 4 else 0
    u = torch.full((n, kp), offset, dtype=torch.int32)  # [n, kp] stored values, padded
    u[:, :k] = values + offset
    if num_bits == 8:
        w = u.to(torch.int8).view(torch.uint8)  # [n, kp]
    else:
        blocks = u.view(n, kp // KERNEL_BLOCK, 2, KERNEL_BLOCK // 2)  # [n, B, lo|hi, 16]
        w = (blocks[:, :, 0] | (blocks[:, :, 1] << 4)).to(torch.uint8).reshape(n, kp // 2)
    out = {"kernel_weight": w.contiguous(), "kernel_scale": scale.float().contiguous()}
    if zero_point is not None:
        out["kernel_zero"] = (zero_point.float() + offset).contiguous()  # [n, G]
    return out


def fp8_kernel_layout(weight: torch.Tensor, scale: torch.Tensor) -> dict[str, torch.Tensor]:
    """FP8 weights [n, in] (float8_e4m3fn) and their per-row scales [n, 1] in the kernel's layout:
    ``kernel_weight`` float8_e4m3fn [n, kp] (zero padded, k order as int8's),
    ``kernel_scale`` float32 [n, 1] (no zero point) and ``scale_dtype``, an empty tensor of the
    checkpoint scales' dtype: the dtype the library dequantizes in (``kernel_dequantize``)."""
    n, k = weight.shape
    kp = -(-k // KERNEL_BLOCK) * KERNEL_BLOCK
    w = torch.zeros(n, kp, dtype=torch.uint8)
    w[:, :k] = weight.view(torch.uint8)
    return {"kernel_weight": w.view(weight.dtype), "kernel_scale": scale.float().reshape(n, 1).contiguous(),
            "scale_dtype": torch.empty(0, dtype=scale.dtype)}


def kernel_dequantize(params: dict[str, torch.Tensor], num_bits: int, in_features: int,
                      group_size: int | None, start: int, stop: int) -> torch.Tensor:
    """Rows ``start:stop`` of a weight in the kernel's layout, dequantized as the kernel does
    (``(stored - zero) * scale`` in float32; FP8: in the checkpoint scales' dtype, as the
    library): [stop - start, in]."""
    w = params["kernel_weight"][start:stop]  # [r, kp·bits/8]
    r = w.shape[0]
    if w.dtype == torch.float8_e4m3fn:  # fp8_kernel_layout: the exact product, rounded once
        return (w[:, :in_features].float() * params["kernel_scale"][start:stop]).to(params["scale_dtype"].dtype)
    if num_bits == 8:
        u = w.view(torch.int8).to(torch.int32)  # [r, kp]
    else:
        b = w.view(r, -1, KERNEL_BLOCK // 2).to(torch.int32)  # [r, B, 16]
        u = torch.stack([b & 15, b >> 4], dim=2).view(r, -1)  # [r, kp]
    zero = params.get("kernel_zero")
    default = torch.full((r, 1), 8.0 if num_bits == 4 else 0.0, device=w.device)
    zero = zero[start:stop] if zero is not None else default  # [r, G]
    scale = params["kernel_scale"][start:stop]  # [r, G]
    g = group_size or in_features
    u = u[:, :in_features].float().view(r, in_features // g, g)  # [r, G, g]
    z = zero.expand(r, in_features // g) if zero.shape[1] == 1 else zero
    return ((u - z.unsqueeze(-1)) * scale.unsqueeze(-1)).view(r, in_features)


class KernelCall:
    """``x @ W.T + b`` by the compiled kernel (``torch.ops.loramux.wq_linear``) for one layer's
    (or one part's) tensors in the kernel's layout, the call's fixed arguments bound once: the
    operator, the tensors, the widths and the bias in float32. A decode step of a quantized
    model makes four of these calls a layer; looking the arguments up and converting the bias
    anew cost more per call than the operator's own checks."""

    __slots__ = ("_op", "_args")

    def __init__(self, params: dict[str, torch.Tensor], num_bits: int, in_features: int,
                 group_size: int | None, bias: torch.Tensor | None, out_dtype: torch.dtype) -> None:
        from loramux.engine.model.kernels import loader

        self._op = loader.require().wq_linear.default
        self._args = (params["kernel_weight"], params["kernel_scale"], params.get("kernel_zero"),
                      bias.float().contiguous() if bias is not None else None, num_bits, in_features,
                      group_size or 0, out_dtype)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, in] float32 or bfloat16 on the CPU → [T, out], accumulated in float32."""
        if x.stride(-1) != 1:
            x = x.contiguous()
        return self._op(x, *self._args)


def kernel_apply(params: dict[str, torch.Tensor], num_bits: int, in_features: int,
                 group_size: int | None, x: torch.Tensor, bias: torch.Tensor | None,
                 out_dtype: torch.dtype) -> torch.Tensor:
    """``x @ W.T + b`` by the compiled kernel once (:class:`KernelCall` binds it for repeated
    calls): x [T, in] float32 or bfloat16 on the CPU → [T, out] ``out_dtype``, accumulated in
    float32; an FP8 layout (``fp8_kernel_layout``) with ``num_bits`` 8."""
    return KernelCall(params, num_bits, in_features, group_size, bias, out_dtype)(x)
