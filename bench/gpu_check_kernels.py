"""Kernel parts of ``bench/gpu_check.py``: the device copy rate, SGMV shrink/expand and
paged attention, each against a float32 torch reference and timed beside torch.

Accuracy: ``err`` is the max abs difference from the fp32 reference computed on the same
(rounded) inputs; ``err_torch`` the same for the torch path in the kernel's dtype. A case
passes when ``err <= max(2 * err_torch, 2 * eps(dtype) * max|ref|)``: as accurate as
torch in that dtype, or within two ulps of the output's scale (eps of fp32 counts as
1e-5: both paths reorder fp32 sums).
"""

from __future__ import annotations

import random
import time

import torch

from bench.source_tree import load_test_support


def token_slots(num_tokens: int, num_adapters: int, seed: int = 0) -> list[int]:
    """Tokens spread evenly over the adapters, interleaved as requests arrive."""
    slots = [i % num_adapters for i in range(num_tokens)]
    random.Random(seed).shuffle(slots)
    return slots


class Timer:
    """Median seconds per call: ``triton.testing.do_bench`` on CUDA (L2 flushed before
    every call, events around it); on the CPU one call (the Triton interpreter is never
    timed for real: a dry run only keeps the code path alive)."""

    def __init__(self, device: torch.device, warmup_ms: int = 10, rep_ms: int = 40) -> None:
        self.device = device
        self.warmup_ms, self.rep_ms = warmup_ms, rep_ms

    def __call__(self, fn) -> float:
        if self.device.type == "cuda":
            from triton.testing import do_bench

            ms = do_bench(fn, warmup=self.warmup_ms, rep=self.rep_ms, return_mode="median")
            return ms / 1e3
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0


def copy_rate(device: torch.device, nbytes: int, timer: Timer) -> dict:
    """Device-to-device copy of ``nbytes``: bytes read + written per second (the ceiling
    the kernels' bandwidth is a fraction of)."""
    src = torch.empty(nbytes // 2, dtype=torch.float16, device=device).normal_()
    dst = torch.empty_like(src)
    secs = timer(lambda: dst.copy_(src))
    return {"bytes": 2 * nbytes, "seconds": secs, "bytes_per_s": 2 * nbytes / secs}


def _tol(dtype: torch.dtype, ref: torch.Tensor, err_torch: float) -> float:
    eps = 1e-5 if dtype == torch.float32 else torch.finfo(dtype).eps
    return max(2.0 * err_torch, 2.0 * eps * float(ref.abs().max()))


def _err(out: torch.Tensor, ref: torch.Tensor) -> float:
    if not bool(torch.isfinite(out).all()):
        return float("inf")
    return float((out.float() - ref).abs().max())


def _check(out, out_torch, ref, dtype) -> dict:
    err, err_torch = _err(out, ref), _err(out_torch, ref)
    tol = _tol(dtype, ref, err_torch)
    rel = float((out.float() - ref).norm() / ref.norm().clamp_min(1e-30))
    return {"err": err, "err_torch": err_torch, "tol": tol, "rel_l2": rel, "ok": err <= tol}


def sgmv_case(
    proj: str, K: int, widths: tuple[int, ...], T: int, rank: int, n_adapters: int,
    dtype: torch.dtype, device: torch.device, timer: Timer, copy_bps: float, *, mode: str,
    seed: int = 0,
) -> dict:
    """Shrink and expand of one projection: error vs fp32, time vs torch, bandwidth."""
    from loramux.engine.lora.meta import LoRABatchMeta
    from loramux.engine.lora.ops import torch_ops, triton_ops

    ref = load_test_support("lora_reference")
    g = torch.Generator(device).manual_seed(seed)

    def rnd(*shape, std=1.0):
        return (torch.randn(*shape, generator=g, device=device) * std).to(dtype)

    S, ns, N = n_adapters, len(widths), sum(widths)
    offs = [0]
    for w in widths:
        offs.append(offs[-1] + w)
    x = rnd(T, K)  # [T, K]
    a = rnd(S, ns, rank, K, std=K**-0.5)  # [slots, slices, R, K]
    b = rnd(S, N, rank, std=rank**-0.5)  # [slots, N, R]
    y0 = rnd(T, N)  # [T, N]
    scale = torch.rand(S, generator=g, device=device) + 0.5
    meta = LoRABatchMeta.build(
        token_slots(T, S, seed), torch.full((S,), rank, dtype=torch.int64), device
    )
    v_ref = ref.reference_shrink(x, a, meta, scale)  # [slices, T_lora, R] fp32
    y_ref = y0.float()
    ref.reference_expand(v_ref, b, meta, y_ref, offs)

    v_k = triton_ops.lora_shrink(x, a, meta, scale)
    v_t = torch_ops.lora_shrink(x, a, meta, scale)
    y_k, y_t = y0.clone(), y0.clone()
    triton_ops.lora_expand(v_ref, b, meta, y_k, offs)  # same v: the expand's error alone
    torch_ops.lora_expand(v_ref, b, meta, y_t, offs)

    es, TL = x.element_size(), meta.num_lora_tokens
    moved = {
        "shrink": TL * K * es + S * ns * rank * K * es + ns * TL * rank * 4,
        "expand": ns * TL * rank * 4 + S * N * rank * es + 2 * TL * N * es,
    }
    y_run = y0.clone()
    runs = {
        "shrink": (
            lambda: triton_ops.lora_shrink(x, a, meta, scale),
            lambda: torch_ops.lora_shrink(x, a, meta, scale),
            _check(v_k, v_t, v_ref, dtype),
        ),
        "expand": (
            lambda: triton_ops.lora_expand(v_ref, b, meta, y_run, offs),
            lambda: torch_ops.lora_expand(v_ref, b, meta, y_run, offs),
            _check(y_k, y_t, y_ref, dtype),
        ),
    }
    case = dict(
        proj=proj, dtype=str(dtype).removeprefix("torch."), mode=mode,
        T=T, rank=rank, adapters=n_adapters, K=K, N=N,
    )
    for op, (kernel, torch_fn, acc) in runs.items():
        secs, secs_torch = timer(kernel), timer(torch_fn)
        case[op] = {
            **acc, "s": secs, "s_torch": secs_torch, "speedup_vs_torch": secs_torch / secs,
            "bytes": moved[op], "bw_frac": moved[op] / secs / copy_bps,
        }
    return case


def _paged_cache(k_seq, v_seq, block_size, g):
    """Scatter per-sequence K/V [B, L, Hkv, D] into a paged cache over shuffled blocks."""
    B, L, Hkv, D = k_seq.shape
    per = -(-L // block_size)
    num_blocks = B * per + 1
    perm = torch.randperm(num_blocks, generator=g)[: B * per].view(B, per)
    pos = torch.arange(L)
    slots = (perm[:, pos // block_size] * block_size + pos % block_size).reshape(-1)  # [B*L]
    k_cache = k_seq.new_zeros(num_blocks * block_size, Hkv, D)
    v_cache = torch.zeros_like(k_cache)
    k_cache.index_copy_(0, slots.to(k_seq.device), k_seq.reshape(B * L, Hkv, D))
    v_cache.index_copy_(0, slots.to(k_seq.device), v_seq.reshape(B * L, Hkv, D))
    return k_cache, v_cache, perm.tolist()


def attention_case(
    mode: str, heads: int, kv_heads: int, head_dim: int, batch: int, prefix: int, chunk: int,
    dtype: torch.dtype, device: torch.device, timer: Timer, seed: int = 0, block_size: int = 16,
) -> dict:
    """Paged attention (Triton) vs SDPA on the same contexts: ``batch`` sequences that
    compute ``n`` new tokens (1 = decode, ``chunk`` = a prompt chunk) after ``prefix``
    cached ones. SDPA reads contiguous K/V (no gather is counted in its time)."""
    import torch.nn.functional as F

    from loramux.engine.model.triton_attention import build_triton_metadata, triton_paged_attention

    n = 1 if mode == "decode" else chunk
    L = prefix + n
    g = torch.Generator().manual_seed(seed)
    gd = torch.Generator(device).manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=gd, device=device).to(dtype)

    k_seq, v_seq = rnd(batch, L, kv_heads, head_dim), rnd(batch, L, kv_heads, head_dim)
    q = rnd(batch * n, heads, head_dim)  # [T, H, D]
    k_cache, v_cache, tables = _paged_cache(k_seq, v_seq, block_size, g)
    meta = build_triton_metadata(tables, [prefix] * batch, [n] * batch, device, block_size)

    qb = q.view(batch, n, heads, head_dim).transpose(1, 2)  # [B, H, n, D]
    kb, vb = k_seq.transpose(1, 2), v_seq.transpose(1, 2)  # [B, Hkv, L, D]
    visible = torch.arange(L, device=device)[None, :] <= (prefix + torch.arange(n, device=device))[:, None]
    group = heads // kv_heads
    # fp32 reference: explicit softmax(q k^T / sqrt(D)) v on the same rounded inputs
    kf = kb.float().repeat_interleave(group, dim=1)
    vf = vb.float().repeat_interleave(group, dim=1)
    scores = (qb.float() @ kf.transpose(-1, -2)) * head_dim**-0.5
    ref = torch.softmax(scores.masked_fill(~visible, float("-inf")), -1) @ vf  # [B, H, n, D]
    ref = ref.transpose(1, 2).reshape(batch * n, heads * head_dim)
    del kf, vf, scores
    mask = None if mode == "decode" else visible

    def sdpa():
        return F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask, enable_gqa=group > 1)

    def kernel():
        return triton_paged_attention(q, k_cache, v_cache, meta, None)  # [T, H * D]

    out = kernel()
    out_t = sdpa().transpose(1, 2).reshape(batch * n, heads * head_dim)
    acc = _check(out, out_t, ref, dtype)
    secs, secs_torch = timer(kernel), timer(sdpa)
    return dict(
        mode=mode, dtype=str(dtype).removeprefix("torch."), heads=heads, kv_heads=kv_heads,
        head_dim=head_dim, batch=batch, prefix=prefix, new=n, **acc,
        s=secs, s_sdpa=secs_torch, speedup_vs_sdpa=secs_torch / secs,
    )
