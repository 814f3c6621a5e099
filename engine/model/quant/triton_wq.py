"""Weight-only int4 / int8 GEMM in Triton (W4A16, W8A16): the CUDA path of every integer
weight-only format (compressed-tensors ``pack-quantized``, AWQ, GPTQ).

**Layout** (made once at load by :func:`prepare`, from either stored layout: compressed-tensors'
``weight_packed`` or the CPU kernel's ``kernel_weight``; the stored tensors are dropped):

- ``wq_weight`` uint8 [in·bits/8 (int4: padded), out]: the unsigned values ``u = v + 2^(bits-1)``
  transposed so that a tile's bytes are contiguous along the output columns (coalesced loads);
  int8: one value a byte, byte ``k``; int4: blocks of B inputs (``int4_block``: 128, or the
  group's largest power-of-two divisor), byte ``j`` of a block holds its input ``j`` in the low
  nibble and ``B/2 + j`` in the high one, so a tile's bytes are loaded once and each half is a
  ``tl.dot`` operand with no interleaving (the last block padded with the midpoint).
- ``wq_scale`` [G, out] in the checkpoint's scale dtype (G = 1 per channel, else in / group).
- ``wq_zero`` uint8 [G, out], the zero point in the unsigned space (``z + 2^(bits-1)``), only
  when asymmetric: the weight is ``(u - wq_zero) * wq_scale``.
- ``perm`` [P, in] kept as stored by GPTQ's activation order (``repacked.py``): a call gathers
  the activations' columns per part, never the weights.

**Kernel** (:func:`wq_matmul`): grid (M tiles, N tiles, split-K); a program walks its K range
one ``BLOCK_K`` tile at a time, a tile never spans two groups (``BLOCK_K`` divides the group),
so it unpacks the tile's integers in registers into x's dtype exactly (fp16 / bf16: the
exponent bits or-ed in, ``_exact``), subtracts the zero point (a [BLOCK_N] vector, or the
midpoint), runs ``tl.dot`` with fp32 accumulation and scales the tile's product by the
group's [BLOCK_N] scales (per channel: once at the end). Decode shapes split K so the grid
covers the GPU; the fp32 partials are summed by torch. From ``DENSE_ROWS`` rows (prefill) the
product is compute-bound and the vendor GEMM beats any dequantizing one: the weight is
dequantized whole into a transient [in, out] copy (:func:`dequantize_t`, as vLLM does for AWQ
from 256 tokens) and torch multiplies. Tested on the CPU under
``TRITON_INTERPRET=1`` (fp32/fp16); timed only on a GPU (``bench/gpu_check_quant.py``).
"""

from __future__ import annotations

import collections
import functools
import logging

import torch

from loramux.engine.model.quant.int_packed import KERNEL_BLOCK, unpack_int32
from loramux.engine.model.triton_import import HAS_TRITON, tl, triton

logger = logging.getLogger(__name__)

__all__ = ["HAS_TRITON", "Config", "apply", "dequantize_rows", "dequantize_t", "fits", "make_layout",
           "prepare", "wq_matmul"]

LAYOUT_KEYS = ("wq_weight", "wq_scale", "wq_zero")
BAND_ELEMS = 1 << 22
"""Weights converted at once while the layout is made."""
DENSE_ROWS = 256
"""Rows of x from which the weight is dequantized whole (transient) and torch multiplies."""

if HAS_TRITON:

    @triton.jit
    def _exact(u, zero, MAGIC: tl.constexpr, OFF: tl.constexpr, DT: tl.constexpr):
        """``u - zero`` in DT, exact: u unsigned [R, BN] (uint8), zero [BN] float32. MAGIC 1
        (fp16) / 2 (bf16, 4 bits): the exponent bits or-ed in make ``OFF + u`` (1024 / 128)
        with no conversion instruction."""
        if MAGIC == 1:
            f = (u.to(tl.uint16) | 0x6400).to(tl.float16, bitcast=True)
        elif MAGIC == 2:
            f = (u.to(tl.uint16) | 0x4300).to(tl.bfloat16, bitcast=True)
        else:
            f = u.to(DT)
        return f - (zero + OFF).to(DT)[None, :]

    @triton.jit
    def _wq_gemm(x_ptr, w_ptr, s_ptr, z_ptr, b_ptr, y_ptr, M, N, K, KW, tiles_per_split,
                 stride_xm, stride_wk, stride_ym, stride_ys,
                 BITS: tl.constexpr, GROUP: tl.constexpr, HAS_ZERO: tl.constexpr,
                 HAS_BIAS: tl.constexpr, MAGIC: tl.constexpr, OFF: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        pid_k = tl.program_id(2)
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
        rmask = rows < M
        cmask = cols < N
        DT: tl.constexpr = x_ptr.dtype.element_ty
        HALF: tl.constexpr = BLOCK_K // 2
        x_rows = x_ptr + rows[:, None].to(tl.int64) * stride_xm  # [BM, 1]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        zero = tl.full((BLOCK_N,), 1 << (BITS - 1), tl.float32)  # the midpoint, or loaded
        if GROUP == 0:  # per channel: one scale (and zero) per column for the whole K
            scale = tl.load(s_ptr + cols, mask=cmask, other=0.0).to(tl.float32)  # [BN]
            if HAS_ZERO:
                zero = tl.load(z_ptr + cols, mask=cmask, other=0).to(tl.float32)
        k_first = pid_k * tiles_per_split * BLOCK_K
        for t in range(0, tiles_per_split):
            k0 = k_first + t * BLOCK_K
            if GROUP != 0:  # the tile lies in one group (past K: the last one, times zeros)
                g = tl.minimum(k0, K - 1) // GROUP
                scale = tl.load(s_ptr + g * stride_wk + cols, mask=cmask, other=0.0).to(tl.float32)
                if HAS_ZERO:
                    zero = tl.load(z_ptr + g * stride_wk + cols, mask=cmask, other=0).to(tl.float32)
            if BITS == 8:
                ks = k0 + tl.arange(0, BLOCK_K)  # [BK]
                kmask = ks < K
                a = tl.load(x_rows + ks[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
                u = tl.load(w_ptr + ks[:, None].to(tl.int64) * stride_wk + cols[None, :],
                            mask=kmask[:, None] & cmask[None, :], other=0)  # [BK, BN] uint8
                q = _exact(u, zero, MAGIC, OFF, DT)
                part = tl.dot(a, q, input_precision=DOT_PRECISION)  # [BM, BN] fp32
            else:  # a layout block: inputs k0 + j in the low nibbles, k0 + HALF + j in the high
                kb = k0 // 2 + tl.arange(0, HALF)  # [HALF] byte rows
                byte = tl.load(w_ptr + kb[:, None].to(tl.int64) * stride_wk + cols[None, :],
                               mask=(kb < KW)[:, None] & cmask[None, :], other=0)  # [HALF, BN]
                ks = k0 + tl.arange(0, HALF)
                a = tl.load(x_rows + ks[None, :], mask=rmask[:, None] & (ks < K)[None, :], other=0.0)
                part = tl.dot(a, _exact(byte & 15, zero, MAGIC, OFF, DT),
                              input_precision=DOT_PRECISION)
                ks += HALF
                a = tl.load(x_rows + ks[None, :], mask=rmask[:, None] & (ks < K)[None, :], other=0.0)
                part += tl.dot(a, _exact(byte >> 4, zero, MAGIC, OFF, DT),
                               input_precision=DOT_PRECISION)
            if GROUP != 0:
                acc += part * scale[None, :]
            else:
                acc += part
        if GROUP == 0:
            acc = acc * scale[None, :]
        if HAS_BIAS:
            acc += tl.load(b_ptr + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
        out = y_ptr + pid_k * stride_ys + rows[:, None].to(tl.int64) * stride_ym + cols[None, :]
        tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=rmask[:, None] & cmask[None, :])

    @triton.jit
    def _wq_dequant(w_ptr, s_ptr, z_ptr, out_ptr, N, K, KW, stride_wk, stride_ok,
                    BITS: tl.constexpr, GROUP: tl.constexpr, HAS_ZERO: tl.constexpr,
                    BLOCK_N: tl.constexpr, ROWS: tl.constexpr):
        k0 = tl.program_id(0) * ROWS * (8 // BITS)  # a tile of one group (int4: a layout block)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
        cmask = cols < N
        g = 0
        if GROUP != 0:
            g = k0 // GROUP
        scale = tl.load(s_ptr + g * stride_wk + cols, mask=cmask, other=0.0).to(tl.float32)
        zero = tl.full((BLOCK_N,), 1 << (BITS - 1), tl.float32)
        if HAS_ZERO:
            zero = tl.load(z_ptr + g * stride_wk + cols, mask=cmask, other=0).to(tl.float32)
        kb = k0 * BITS // 8 + tl.arange(0, ROWS)  # [ROWS] byte rows
        u = tl.load(w_ptr + kb[:, None].to(tl.int64) * stride_wk + cols[None, :],
                    mask=(kb < KW)[:, None] & cmask[None, :], other=0)
        ks = k0 + tl.arange(0, ROWS)
        dst = out_ptr + ks[:, None].to(tl.int64) * stride_ok + cols[None, :]
        DT: tl.constexpr = out_ptr.dtype.element_ty
        if BITS == 4:
            lo = _exact(u & 15, zero, 0, 0.0, tl.float32) * scale[None, :]
            tl.store(dst, lo.to(DT), mask=(ks < K)[:, None] & cmask[None, :])
            hi = _exact(u >> 4, zero, 0, 0.0, tl.float32) * scale[None, :]
            tl.store(dst + ROWS * stride_ok, hi.to(DT), mask=(ks + ROWS < K)[:, None] & cmask[None, :])
        else:
            w = _exact(u, zero, 0, 0.0, tl.float32) * scale[None, :]
            tl.store(dst, w.to(DT), mask=(ks < K)[:, None] & cmask[None, :])


def _block_k(group_size: int | None, cap: int) -> int:
    """The largest power of two <= ``cap`` dividing the group (per channel: ``cap``)."""
    if not group_size:
        return cap
    return min(cap, group_size & -group_size)


def int4_block(group_size: int | None) -> int:
    """Inputs per block of the int4 layout (a kernel tile; one group's or a part of it)."""
    return _block_k(group_size, 128)


def fits(group_size: int | None, bits: int = 4) -> bool:
    """Whether the kernel runs this grouping: per channel, or groups divisible by 16 (int8) /
    32 (int4: a layout block's halves are tiles of ``tl.dot``) — a tile never spans two groups."""
    return _block_k(group_size, 128) >= (32 if bits == 4 else 16)


Config = collections.namedtuple("Config", "bm bn bk split per warps stages")
"""A launch of :func:`_wq_gemm`: tiles (M, N, K), K split into ``split`` ranges of ``per``
tiles, warps and pipeline stages."""


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


@functools.lru_cache(maxsize=4096)
def _config(m: int, n: int, k: int, bits: int, group_size: int | None, device: torch.device,
            split_k: int | None = None) -> Config:
    """The launch for an [m, k] x [k, n] product: small-M (decode) tiles split K until the
    grid covers the GPU's SMs ``TUNE["fill"]`` times (``split_k`` overrides); int4 tiles are
    the layout's blocks."""
    if m <= 16:
        bm, bn, cap, warps = 16, TUNE["bn"], 128, 4
    elif m <= 64:
        bm, bn, cap, warps = (32 if m <= 32 else 64), 64, 128, 4
    else:
        bm, bn, cap, warps = 64, 128, 64, 8
    bk = int4_block(group_size) if bits == 4 else _block_k(group_size, cap)
    k_tiles = triton.cdiv(k, bk)
    if split_k is None:
        grid = triton.cdiv(m, bm) * triton.cdiv(n, bn)
        split_k = max(1, min(TUNE["fill"] * _sm_count(device) // grid, k_tiles // TUNE["min_tiles"]))
    per = triton.cdiv(k_tiles, max(1, min(split_k, k_tiles)))
    return Config(bm, bn, bk, triton.cdiv(k_tiles, per), per, warps, TUNE["stages"])


TUNE = {"bn": 64, "fill": 4, "min_tiles": 2, "stages": 3}
"""Decode launch choices: the best of a sweep on an H200 (BLOCK_N 32-128, the grid filling the
SMs 1-16 times) for Llama-7B projections at T = 1 (read once: ``_config`` caches)."""


def wq_matmul(x: torch.Tensor, layout: dict[str, torch.Tensor], bits: int, group_size: int | None,
              bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
              split_k: int | None = None, config: Config | None = None) -> torch.Tensor:
    """``x @ W.T + b``: x [M, in] (fp16 / bf16 / fp32) and W in :func:`make_layout`'s layout
    → [M, out] ``out_dtype`` (default x's), fp32 accumulation. From ``DENSE_ROWS`` rows the
    weight is dequantized into x's dtype and multiplied by torch (compute-bound: the vendor
    GEMM wins). ``split_k`` / ``config`` override the heuristic (tests, tuning)."""
    if not HAS_TRITON:
        raise RuntimeError("the Triton weight-only GEMM needs the triton package")
    w, scale, zero = layout["wq_weight"], layout["wq_scale"], layout.get("wq_zero")
    m, k = x.shape
    n = w.shape[1]
    out_dtype = out_dtype or x.dtype
    if x.stride(-1) != 1:
        x = x.contiguous()
    if m == 0:
        return x.new_empty(0, n, dtype=out_dtype)
    if m >= DENSE_ROWS and config is None:
        wt = dequantize_t(layout, bits, group_size, k, x.dtype)  # [in, out]
        y = torch.addmm(bias.to(x.dtype), x, wt) if bias is not None else x @ wt
        return y.to(out_dtype)
    c = config or _config(m, n, k, bits, group_size, x.device, split_k)
    y = torch.empty((c.split, m, n) if c.split > 1 else (m, n), device=x.device,
                    dtype=torch.float32 if c.split > 1 else out_dtype)
    b = bias if bias is not None and c.split == 1 else None
    magic = (1 if x.dtype == torch.float16 else 2 if x.dtype == torch.bfloat16 and bits == 4 else 0)
    _wq_gemm[(triton.cdiv(m, c.bm), triton.cdiv(n, c.bn), c.split)](
        x, w, scale, zero if zero is not None else scale, b if b is not None else scale, y,
        m, n, k, w.shape[0], c.per, x.stride(0), w.stride(0), y.stride(-2),
        y.stride(0) if c.split > 1 else 0, BITS=bits, GROUP=group_size or 0,
        HAS_ZERO=zero is not None, HAS_BIAS=b is not None, MAGIC=magic,
        OFF=(0.0, 1024.0, 128.0)[magic], BLOCK_M=c.bm, BLOCK_N=c.bn, BLOCK_K=c.bk,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else None,  # fp32: no TF32
        num_warps=c.warps, num_stages=c.stages)
    if c.split == 1:
        return y
    y = y.sum(0)  # [M, N] fp32
    if bias is not None:
        y += bias.float()
    return y.to(out_dtype)


def dequantize_t(layout: dict[str, torch.Tensor], bits: int, group_size: int | None, k: int,
                 dtype: torch.dtype) -> torch.Tensor:
    """The whole weight transposed, ``W.T`` [in, out] in ``dtype`` (``(u - zero) * scale`` in
    float32, rounded once), by :func:`_wq_dequant` (a prefill's transient copy)."""
    w, scale, zero = layout["wq_weight"], layout["wq_scale"], layout.get("wq_zero")
    n = w.shape[1]
    out = torch.empty(k, n, device=w.device, dtype=dtype)
    tile = int4_block(group_size) if bits == 4 else _block_k(group_size, 64)
    rows = tile // 2 if bits == 4 else tile  # byte rows a program reads
    _wq_dequant[(triton.cdiv(k, tile), triton.cdiv(n, 128))](
        w, scale, zero if zero is not None else scale, out, n, k, w.shape[0], w.stride(0),
        out.stride(0), BITS=bits, GROUP=group_size or 0, HAS_ZERO=zero is not None,
        BLOCK_N=128, ROWS=rows)
    return out


def pack(values: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, bits: int,
         group_size: int | None) -> dict[str, torch.Tensor]:
    """Signed values [n, in] (int), scale [n, G], signed zero points [n, G] or None → the
    layout's tensors for these n output rows (columns of ``wq_weight``)."""
    mid = 1 << (bits - 1)
    u = (values.to(torch.int32) + mid).T  # [in, n]
    if bits == 4:
        blk = int4_block(group_size)
        k, n = u.shape
        kp = -(-k // blk) * blk
        if kp != k:
            u = torch.cat([u, u.new_full((kp - k, n), mid)])
        u = u.view(kp // blk, 2, blk // 2, n)  # [blocks, lo | hi, half, n]
        u = (u[:, 0] | (u[:, 1] << 4)).reshape(kp // 2, n)
    out = {"wq_weight": u.to(torch.uint8).contiguous(), "wq_scale": scale.T.contiguous()}
    if zero is not None:
        out["wq_zero"] = (zero.to(torch.int32) + mid).T.to(torch.uint8).contiguous()
    return out


def _stored_rows(params: dict[str, torch.Tensor], bits: int, k: int, r0: int, r1: int):
    """Rows ``r0:r1`` of a stored layout as (signed values [r, in], scale [r, G], signed zero
    [r, G] or None)."""
    if "weight_packed" in params:  # compressed-tensors
        zp = params.get("weight_zero_point")
        return (unpack_int32(params["weight_packed"][r0:r1], bits, k), params["weight_scale"][r0:r1],
                zp[r0:r1] if zp is not None else None)
    w = params["kernel_weight"][r0:r1]  # the CPU kernel's (int_packed.kernel_layout)
    r, off = w.shape[0], 8 if bits == 4 else 0
    if bits == 8:
        v = w.view(torch.int8).to(torch.int32)
    else:
        blk = w.view(r, -1, KERNEL_BLOCK // 2).to(torch.int32)  # [r, B, 16]
        v = torch.stack([blk & 15, blk >> 4], dim=2).view(r, -1) - off
    zero = params.get("kernel_zero")
    zero = (zero[r0:r1] - off).round().to(torch.int32) if zero is not None else None
    return v[:, :k], params["kernel_scale"][r0:r1], zero


def make_layout(params: dict[str, torch.Tensor], bits: int, group_size: int | None,
                in_features: int) -> dict[str, torch.Tensor] | None:
    """The kernel's layout of a layer stored as compressed-tensors' ``weight_packed`` or the
    CPU kernel's ``kernel_weight`` (``perm`` kept), a band of rows at a time on the weights'
    device; None when neither (FP8) or the kernel does not run it."""
    if bits not in (4, 8) or not fits(group_size, bits) or not ({"weight_packed", "kernel_weight"} & set(params)):
        return None
    key = "weight_packed" if "weight_packed" in params else "kernel_weight"
    n = params[key].shape[0]
    step = max(1, BAND_ELEMS // in_features)
    bands = [pack(*_stored_rows(params, bits, in_features, r, min(r + step, n)), bits, group_size)
             for r in range(0, n, step)]
    out = {name: torch.cat([b[name] for b in bands], dim=1) for name in bands[0]}
    if "perm" in params:
        out["perm"] = params["perm"]
    return out


def prepare(layer) -> bool:
    """Replaces a :class:`~loramux.engine.model.quant.base.QuantLinear`'s stored tensors by the
    kernel's layout (called once at load for a layer on a CUDA device, where Triton is
    installed); False, nothing changed, when the kernel does not run this layer."""
    bits, group = getattr(layer.scheme, "num_bits", 0), getattr(layer.scheme, "group_size", None)
    layout = make_layout(layer.params, bits, group, layer.kernel_in_features)
    note = ("Triton wq_gemm" if layout is not None else "torch dequantize-then-matmul (the Triton "
            "kernel takes int4 / int8 per channel or groups of 32k (int4) / 16k (int8))")
    if (layer.scheme, note) not in _LOGGED:
        _LOGGED.add((layer.scheme, note))
        logger.info("quantized linears on %s (%s): %s", layer.device, layer.scheme.describe(), note)
    if layout is None:
        return False
    layer.params = layout
    return True


_LOGGED: set = set()  # (scheme, path) pairs logged


def _parts(layer):
    """``(r0, r1, perm or None)`` per output-row part with its own column order."""
    perm = layer.params.get("perm")
    if perm is None:
        return [(0, layer.out_features, None)]
    bounds = layer.scheme.bounds
    return [(bounds[i], bounds[i + 1], p) for i, p in enumerate(perm)]


def apply(layer, x: torch.Tensor) -> torch.Tensor:
    """``x @ W.T + b`` for x [T, in] → [T, out] in the layer's dtype by :func:`wq_matmul`
    (per part, the activations' columns gathered by ``perm``). Called by
    ``WeightOnlyMethod.apply`` for a layer :func:`prepare` converted."""
    x = x.to(layer.compute_dtype)
    bits, group = layer.scheme.num_bits, layer.scheme.group_size
    outs = []
    for r0, r1, perm in _parts(layer):
        part = {k: layer.params[k][:, r0:r1] for k in LAYOUT_KEYS if k in layer.params}
        bias = layer.bias[r0:r1] if layer.bias is not None else None
        xs = x.index_select(-1, perm) if perm is not None else x
        outs.append(wq_matmul(xs, part, bits, group, bias, layer.dtype))
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)


def dequantize_rows(layer, start: int, stop: int) -> torch.Tensor:
    """Output rows ``start:stop`` of a converted layer, ``(u - zero) * scale`` in the scale's
    dtype, in the checkpoint's input-column order: [stop - start, in]."""
    p, bits, k = layer.params, layer.scheme.num_bits, layer.kernel_in_features
    u = p["wq_weight"][:, start:stop].to(torch.int32)  # [in·bits/8 (padded), r]
    if bits == 4:
        half = int4_block(layer.scheme.group_size) // 2
        u = u.view(-1, 1, half, u.shape[1])  # [blocks, 1, half, r]
        u = torch.cat([u & 15, u >> 4], dim=1).view(-1, u.shape[-1])  # [in (padded), r]
    u = u[:k].T  # [r, in]
    scale = p["wq_scale"][:, start:stop].T  # [r, G]
    zero = p["wq_zero"][:, start:stop].T.to(scale.dtype) if "wq_zero" in p else None
    r, groups = scale.shape
    q = u.to(scale.dtype).view(r, groups, k // groups)
    q = q - (zero.unsqueeze(-1) if zero is not None else float(1 << (bits - 1)))
    return layer.checkpoint_columns((q * scale.unsqueeze(-1)).view(r, k), start)
