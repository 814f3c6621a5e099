"""Fake (meta) implementations of the ``torch.ops.loramux`` operators.

They run where a tensor has no data (``FakeTensorMode``, ``torch.compile`` tracing, meta
tensors) and check what can be checked without data, as the CPU implementations in
``csrc/ops.cpp`` do: dtypes, dimensions, strides, devices and how the shapes relate. The index
*values* (block ids, positions, runs) are checked by the CPU implementations only. Each returns
a tensor of the shape and dtype the real operator returns. Registered by :mod:`.loader` once
the extension has loaded.
"""

from __future__ import annotations

import torch

_FLOATS = (torch.float32, torch.bfloat16)


def _check(cond: bool, op: str, message: str) -> None:
    torch._check(cond, lambda: f"loramux::{op}: {message}")


def _float(t: torch.Tensor, op: str, name: str) -> None:
    _check(t.dtype in _FLOATS, op, f"{name} must be float32 or bfloat16, got {t.dtype}")


def _dim(t: torch.Tensor, dim: int, op: str, name: str) -> None:
    _check(t.dim() == dim, op, f"{name} must have {dim} dimensions, got shape {tuple(t.shape)}")


def _rows(t: torch.Tensor, op: str, name: str) -> None:
    _dim(t, 2, op, name)
    _float(t, op, name)
    _check(t.stride(1) == 1 or t.shape[1] <= 1, op,
           f"{name} must have dense rows (stride 1 along the last dimension), got strides {t.stride()}")


def _contiguous(t: torch.Tensor, op: str, name: str) -> None:
    _check(t.is_contiguous(), op, f"{name} must be contiguous, got strides {t.stride()}")


def _index(t: torch.Tensor, dtype: torch.dtype, dim: int, op: str, name: str) -> None:
    _check(t.dtype == dtype, op, f"{name} must be {dtype}, got {t.dtype}")
    _dim(t, dim, op, name)
    _contiguous(t, op, name)


def _same_device(op: str, *tensors: torch.Tensor | None) -> None:
    devices = {t.device for t in tensors if t is not None}
    _check(len(devices) == 1, op, f"every tensor must be on one device, got {sorted(map(str, devices))}")


def _same_dtype(a: torch.Tensor, b: torch.Tensor, op: str, an: str, bn: str) -> None:
    _check(a.dtype == b.dtype, op, f"{bn} ({b.dtype}) must have the dtype of {an} ({a.dtype})")


def _out_dtype(dtype: torch.dtype, op: str) -> None:
    _check(dtype in _FLOATS, op, f"out_dtype must be float32 or bfloat16, got {dtype}")


def paged_attention(q, k_cache, v_cache, out, block_tables, row_start, num_new, ctx_len,
                    block_size, scale, window=0, softcap=0.0) -> None:
    op = "paged_attention"
    _same_device(op, q, k_cache, v_cache, out, block_tables, row_start, num_new, ctx_len)
    _dim(q, 3, op, "q")
    _float(q, op, "q")
    _, heads, head_dim = q.shape
    _check(heads > 0 and head_dim > 0, op, f"q [T, H, D] needs heads and a head dim, got {tuple(q.shape)}")
    _check(q.stride(2) == 1 and q.stride(1) == head_dim, op,
           f"q [T, H, D] must have its heads and dims dense (any token stride), got strides {q.stride()}")
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        _dim(c, 3, op, name)
        _contiguous(c, op, name)
        _same_dtype(q, c, op, "q", name)
    _check(k_cache.shape == v_cache.shape, op,
           f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} must have one shape")
    _check(k_cache.shape[2] == head_dim, op,
           f"the caches' head dim ({k_cache.shape[2]}) must equal q's ({head_dim})")
    _check(k_cache.shape[1] > 0 and heads % k_cache.shape[1] == 0, op,
           f"q's {heads} heads must be a multiple of the caches' {k_cache.shape[1]} KV heads")
    _dim(out, 2, op, "out")
    _contiguous(out, op, "out")
    _same_dtype(q, out, op, "q", "out")
    _check(out.shape[1] == heads * head_dim, op,
           f"out must be [T, H * D] = [*, {heads * head_dim}], got {tuple(out.shape)}")
    _index(block_tables, torch.int32, 2, op, "block_tables")
    for name, t in (("row_start", row_start), ("num_new", num_new), ("ctx_len", ctx_len)):
        _index(t, torch.int32, 1, op, name)
        _check(t.shape[0] == block_tables.shape[0], op,
               f"{name} must have one entry per block table row ({block_tables.shape[0]}), got {t.shape[0]}")
    torch._check_value(block_size > 0, lambda: f"loramux::{op}: block_size must be positive")
    torch._check_value(window >= 0, lambda: f"loramux::{op}: window must be >= 0 (0 = none)")
    torch._check_value(scale > 0, lambda: f"loramux::{op}: scale must be a positive number")
    torch._check_value(softcap >= 0, lambda: f"loramux::{op}: softcap must be >= 0 (0 = none)")


def add_rms_norm(residual, delta, weight, eps, out_dtype, unit_offset=False) -> torch.Tensor:
    op = "add_rms_norm"
    _same_device(op, residual, delta, weight)
    _rows(residual, op, "residual")
    _out_dtype(out_dtype, op)
    _dim(weight, 1, op, "weight")
    _contiguous(weight, op, "weight")
    _same_dtype(residual, weight, op, "residual", "weight")
    _check(weight.shape[0] == residual.shape[1], op,
           f"weight must be [{residual.shape[1]}], got {tuple(weight.shape)}")
    if delta is not None:
        _rows(delta, op, "delta")
        _check(delta.shape == residual.shape, op,
               f"delta {tuple(delta.shape)} must have the shape of residual {tuple(residual.shape)}")
    torch._check_value(eps >= 0, lambda: f"loramux::{op}: eps must be >= 0")
    return residual.new_empty(residual.shape, dtype=out_dtype)


def rope(qk, positions, cos, sin) -> None:
    op = "rope"
    _same_device(op, qk, positions, cos, sin)
    _dim(qk, 3, op, "qk")
    _float(qk, op, "qk")
    tokens, _, head_dim = qk.shape
    _check(qk.stride(2) == 1 and qk.stride(1) == head_dim, op,
           f"qk [T, heads, D] must have its heads and dims dense (any token stride), got strides {qk.stride()}")
    _check(head_dim % 2 == 0, op, f"the head dim must be even, got {head_dim}")
    for name, t in (("cos", cos), ("sin", sin)):
        _dim(t, 2, op, name)
        _contiguous(t, op, name)
        _same_dtype(qk, t, op, "qk", name)
        _check(t.shape[1] == head_dim, op, f"{name} must be [positions, {head_dim}], got {tuple(t.shape)}")
    _check(cos.shape == sin.shape, op, f"cos {tuple(cos.shape)} and sin {tuple(sin.shape)} must have one shape")
    _index(positions, torch.int64, 1, op, "positions")
    _check(positions.shape[0] == tokens, op,
           f"positions must have one entry per token ({tokens}), got {positions.shape[0]}")


def _act_mul(op: str, gate_up, out_dtype) -> torch.Tensor:
    _rows(gate_up, op, "gate_up")
    _out_dtype(out_dtype, op)
    tokens, two_i = gate_up.shape
    _check(two_i % 2 == 0, op, f"gate_up must be [T, 2 * I] (gate | up), got {tuple(gate_up.shape)}")
    return gate_up.new_empty((tokens, two_i // 2), dtype=out_dtype)


def silu_mul(gate_up, out_dtype) -> torch.Tensor:
    return _act_mul("silu_mul", gate_up, out_dtype)


def gelu_tanh_mul(gate_up, out_dtype) -> torch.Tensor:
    return _act_mul("gelu_tanh_mul", gate_up, out_dtype)


def lora_sgmv(y, x, a, b, runs, ranks, slice_offsets) -> None:
    op = "lora_sgmv"
    _same_device(op, y, x, a, b, runs, ranks, slice_offsets)
    _rows(y, op, "y")
    _rows(x, op, "x")
    _check(x.shape[0] == y.shape[0], op,
           f"x {tuple(x.shape)} and y {tuple(y.shape)} must have one row per token")
    _dim(a, 4, op, "a")
    _contiguous(a, op, "a")
    _float(a, op, "a")
    _dim(b, 3, op, "b")
    _contiguous(b, op, "b")
    _same_dtype(a, b, op, "a", "b")
    slots, slices, rank, k = a.shape
    _check(k == x.shape[1], op, f"a [slots, S, R, K] has K = {k}, x has {x.shape[1]} columns")
    _check(tuple(b.shape) == (slots, slices * rank, y.shape[1]), op,
           f"b must be [slots, S * R, N] = [{slots}, {slices * rank}, {y.shape[1]}], got {tuple(b.shape)}")
    _index(runs, torch.int64, 2, op, "runs")
    _check(runs.shape[1] == 3, op, f"runs must be [n, 3] (start, end, slot), got {tuple(runs.shape)}")
    _index(ranks, torch.int64, 1, op, "ranks")
    _check(ranks.shape[0] == slots, op, f"ranks must have one entry per slot ({slots}), got {ranks.shape[0]}")
    _index(slice_offsets, torch.int64, 1, op, "slice_offsets")
    torch._check_value(slice_offsets.shape[0] == slices + 1,
                       lambda: f"loramux::{op}: slice_offsets must be {slices + 1} ints from 0 to {y.shape[1]}")


def wq_linear(x, w, scale, zero, bias, bits, in_features, group_size, out_dtype):
    op = "wq_linear"
    _same_device(op, x, w, scale, zero, bias)
    _rows(x, op, "x")
    _out_dtype(out_dtype, op)
    torch._check_value(bits in (4, 8), lambda: f"loramux::{op}: bits must be 4 or 8, got {bits}")
    _check(x.shape[1] == in_features, op, f"x has {x.shape[1]} columns, in_features is {in_features}")
    kp = -(-in_features // 32) * 32
    _dim(w, 2, op, "w")
    _contiguous(w, op, "w")
    fp8 = w.dtype == torch.float8_e4m3fn
    _check(w.dtype == torch.uint8 or fp8, op,
           f"w must be uint8 (packed integers) or float8_e4m3fn, got {w.dtype}")
    torch._check_value(not fp8 or (bits == 8 and zero is None),
                       lambda: f"loramux::{op}: float8_e4m3fn weights take bits 8 and no zero")
    _check(w.shape[1] == kp * bits // 8, op, f"w must be [N, {kp * bits // 8}], got {tuple(w.shape)}")
    groups = in_features // group_size if group_size else 1
    for name, t in (("scale", scale), ("zero", zero)):
        if t is not None:
            _check(t.dtype == torch.float32 and tuple(t.shape) == (w.shape[0], groups), op,
                   f"{name} must be float32 [{w.shape[0]}, {groups}], got {t.dtype} {tuple(t.shape)}")
    return x.new_empty((x.shape[0], w.shape[0]), dtype=out_dtype)


FAKES = {
    "paged_attention": paged_attention, "add_rms_norm": add_rms_norm, "rope": rope,
    "silu_mul": silu_mul, "gelu_tanh_mul": gelu_tanh_mul, "lora_sgmv": lora_sgmv,
    "wq_linear": wq_linear,
}
"""Operator name -> its fake implementation."""


def register() -> None:
    """Register every fake implementation (called once, after the extension loaded)."""
    for name, fn in FAKES.items():
        torch.library.register_fake(f"loramux::{name}", fn)
