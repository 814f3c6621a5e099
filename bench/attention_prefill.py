"""Fresh-prompt attention on the CPU: the C kernel's prompt tiles ÷ torch's SDPA, same run.

A step's fresh prompts (no cached prefix) are causal attention of each prompt over itself. The
engine sends them to the paged C kernel (``loramux::paged_attention``, reading the blocks in
place) as it does decode rows and chunks over a cached prefix; this benchmark times that against
``F.scaled_dot_product_attention(is_causal=True, enable_gqa=True)`` on the same tensors (what
the engine called for them before), over batches of prompts of one length, in both dtypes,
with the default model's heads (9 query, 3 KV, head size 64). Reports the best of ``--repeats``
calls per cell, the ratio SDPA ÷ kernel (> 1: the kernel is faster) and the largest
difference between the two outputs. Writes bench/results/<out>.json.

    python -m bench.attention_prefill            # ~1 minute on 2 cores
    python -m bench.attention_prefill --quick
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from bench.common import bench_parser, cpu_name, write_json

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16
SHAPES = [(1, 64), (8, 64), (1, 256), (8, 256), (1, 448), (8, 448), (1, 1024), (2, 2048)]


def best_ms(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def paged_inputs(batch: int, length: int, dtype: torch.dtype, seed: int = 0):
    """q, k, v of ``batch`` prompts of ``length`` tokens, and K/V written into a paged cache."""
    from loramux.engine.model.cpu_attention import build_cpu_metadata

    g = torch.Generator().manual_seed(seed)
    rows = batch * length
    q, k, v = (torch.randn(rows, h, HEAD_DIM, generator=g).to(dtype) for h in (HEADS, KV_HEADS, KV_HEADS))
    per_seq = -(-length // BLOCK)
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(batch)]
    slots = torch.cat([torch.tensor(t).repeat_interleave(BLOCK)[:length] * BLOCK + torch.arange(length) % BLOCK
                       for t in tables])
    k_cache = torch.zeros(batch * per_seq * BLOCK, KV_HEADS, HEAD_DIM, dtype=dtype).index_copy_(0, slots, k)
    v_cache = torch.zeros_like(k_cache).index_copy_(0, slots, v)
    meta = build_cpu_metadata(tables, [i * length for i in range(batch)], [0] * batch, [length] * batch,
                              BLOCK, None)
    return q, k, v, k_cache, v_cache, meta


def cell(batch: int, length: int, dtype: torch.dtype, repeats: int) -> dict:
    from loramux.engine.model.cpu_attention import cpu_paged_attention

    q, k, v, k_cache, v_cache, meta = paged_inputs(batch, length, dtype)
    out = torch.empty(batch * length, HEADS * HEAD_DIM, dtype=dtype)
    kernel_ms = best_ms(lambda: cpu_paged_attention(q, k_cache, v_cache, out, meta), repeats)
    qs, ks, vs = (t.view(batch, length, -1, HEAD_DIM).transpose(1, 2) for t in (q, k, v))

    def sdpa():
        return F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)

    sdpa_ms = best_ms(sdpa, repeats)
    ref = sdpa().transpose(1, 2).reshape(batch * length, HEADS * HEAD_DIM)
    return {"batch": batch, "length": length, "dtype": str(dtype).removeprefix("torch."),
            "kernel_ms": round(kernel_ms, 3), "sdpa_ms": round(sdpa_ms, 3),
            "sdpa_over_kernel": round(sdpa_ms / kernel_ms, 3),
            "max_abs_diff": float((ref.float() - out.float()).abs().max())}


def main() -> None:
    ap = bench_parser(__doc__, dtype=None, quick="three shapes, fewer repeats", out="attention_prefill")
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    shapes = SHAPES[1::3] if args.quick else SHAPES
    repeats = 3 if args.quick else args.repeats
    rows = []
    for dtype in (torch.bfloat16, torch.float32):
        for batch, length in shapes:
            r = cell(batch, length, dtype, repeats)
            rows.append(r)
            print(f"{r['dtype']:9s} {batch} x {length:5d}: kernel {r['kernel_ms']:8.2f} ms  "
                  f"SDPA {r['sdpa_ms']:8.2f} ms  SDPA/kernel {r['sdpa_over_kernel']:5.2f}  "
                  f"max diff {r['max_abs_diff']:.3g}")
    path = write_json(args.out, {"cpu": cpu_name(), "heads": [HEADS, KV_HEADS, HEAD_DIM], "cells": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
