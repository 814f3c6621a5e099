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
