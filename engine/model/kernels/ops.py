"""The CPU kernels' Python entry points: typed wrappers over ``torch.ops.loramux.*``.

Stable names for the model code (``small_ops.py``, ``cpu_attention.py``, ``lora/ops/cpu_sgmv.py``
and the model families): call these, not ``torch.ops.loramux`` directly. Each checks its
arguments in the operator itself (a wrong dtype, shape, device, stride or index raises
``RuntimeError`` or ``ValueError``), runs fp32 or bf16 CPU tensors, and shows in
``torch.profiler`` as ``loramux::<name>``. Call them only where :func:`.loader.available` is
true (the extension is loaded); the torch paths are the fallback and the reference.
"""

from __future__ import annotations

import torch

from loramux.engine.model.kernels import loader


def paged_attention(
    q: torch.Tensor,  # [T, H, D] fp32/bf16 (any token stride; heads and dims dense)
    k_cache: torch.Tensor,  # [S, Hkv, D] contiguous, q's dtype
    v_cache: torch.Tensor,  # [S, Hkv, D]
    out: torch.Tensor,  # [T, H * D] contiguous, q's dtype: the sequences' rows are written
    block_tables: torch.Tensor,  # [nseq, W] int32 block ids
    row_start: torch.Tensor,  # [nseq] int32 first row of each sequence in q / out
    num_new: torch.Tensor,  # [nseq] int32 rows (new tokens) of each sequence
    ctx_len: torch.Tensor,  # [nseq] int32 context length after the step
    *,
    block_size: int,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
) -> None:
    """Causal attention of each sequence's new rows over its cached context (K/V read from
    the paged cache in place), written into ``out``. ``scale``: the softmax scale (scores are
    ``q . k * scale``); ``window`` > 0: only the last ``window`` positions are visible
    (sliding window), 0 = all; ``softcap`` > 0: scores become ``softcap * tanh(s / softcap)``
    (Gemma 2's attention logit soft-capping), 0 = none."""
    loader.require().paged_attention.default(q, k_cache, v_cache, out, block_tables, row_start, num_new,
                                   ctx_len, block_size, scale, window, softcap)


def add_rms_norm(
    residual: torch.Tensor,  # [T, H] fp32/bf16, dense rows; updated in place when delta is given
    delta: torch.Tensor | None,  # [T, H] fp32/bf16, dense rows
    weight: torch.Tensor,  # [H] residual's dtype
    eps: float,
    *,
    out_dtype: torch.dtype | None = None,
    unit_offset: bool = False,
) -> torch.Tensor:  # [T, H] out_dtype
    """``residual += delta`` (when given, rounded as the eager add), then RMSNorm: Llama's
    ``weight * (normalized residual, rounded to its dtype)``, or with ``unit_offset`` Gemma's
    ``(normalized residual * (1 + weight))`` all in fp32, rounded once. ``out_dtype`` (default
    the residual's) may be fp32 for a bf16 model whose matmuls run in fp32: it then holds the
    bf16-rounded values."""
    return loader.require().add_rms_norm.default(residual, delta, weight, eps,
                                       out_dtype or residual.dtype, unit_offset)


def rope(
    qk: torch.Tensor,  # [T, heads, D] fp32/bf16, heads and dims dense (any token stride)
    positions: torch.Tensor,  # [T] int64 rows of the tables
    cos: torch.Tensor,  # [P, D] qk's dtype, contiguous
    sin: torch.Tensor,  # [P, D]
) -> torch.Tensor:
    """Rotary embedding (rotate-half layout) of ``qk`` in place; returns ``qk``."""
    loader.require().rope.default(qk, positions, cos, sin)
    return qk


def silu_mul(gate_up: torch.Tensor, *, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``silu(gate) * up`` for gate|up [T, 2I] (dense rows) → [T, I] in ``out_dtype``
    (default gate_up's), rounded as the eager ops round."""
    return loader.require().silu_mul.default(gate_up, out_dtype or gate_up.dtype)


def gelu_tanh_mul(gate_up: torch.Tensor, *, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``gelu(gate, approximate="tanh") * up`` (GeGLU, ``gelu_pytorch_tanh``) for gate|up
    [T, 2I] → [T, I] in ``out_dtype`` (default gate_up's), rounded as the eager ops round."""
    return loader.require().gelu_tanh_mul.default(gate_up, out_dtype or gate_up.dtype)


def lora_sgmv(
    y: torch.Tensor,  # [T, N] fp32/bf16, dense rows: updated in place
    x: torch.Tensor,  # [T, K] fp32/bf16, dense rows
    a: torch.Tensor,  # [slots, S, R, K] pre-scaled A, contiguous
    b: torch.Tensor,  # [slots, S * R, N] block-diagonal B (a's dtype), contiguous
    runs: torch.Tensor,  # [n, 3] int64 (start, end, slot): ordered, disjoint
    ranks: torch.Tensor,  # [slots] int64 each slot's rank (rows of A / B read)
    slice_offsets: torch.Tensor,  # [S + 1] int64 output columns of each slice, 0 .. N
) -> None:
    """``y[t] += (x[t] @ A[slot].T) @ B[slot]`` for every token of ``runs`` (multi-LoRA SGMV):
    each slot's A and B read in place, only as many rows as its rank."""
    loader.require().lora_sgmv.default(y, x, a, b, runs, ranks, slice_offsets)


def wq_linear(
    x: torch.Tensor,  # [M, K] fp32/bf16, dense rows
    w: torch.Tensor,  # [N, Kp * bits / 8] uint8, the kernel's layout (int_packed.kernel_layout)
    scale: torch.Tensor,  # [N, G] float32
    zero: torch.Tensor | None,  # [N, G] float32 stored-value offsets, or None (symmetric)
    bias: torch.Tensor | None,  # [N] float32
    *,
    bits: int,
    in_features: int,
    group_size: int,  # 0: one scale per row; else a multiple of 32 dividing in_features
    out_dtype: torch.dtype,
) -> torch.Tensor:  # [M, N] out_dtype
    """Weight-only int8 / int4 linear ``x @ dequant(W).T + bias``, a block of 32 weights
    dequantized at a time in registers, accumulated in float32 (``csrc/wq_linear.c``)."""
    return loader.require().wq_linear.default(x, w, scale, zero, bias, bits, in_features,
                                              group_size, out_dtype)
