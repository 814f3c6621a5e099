"""The native-bf16 CPU kernels against the fp32-FMA kernels they stand beside, on bf16 inputs.

On a CPU with AVX512_BF16 the kernels' ``avx512bf16`` ISA variant runs the bf16 paths
(VDPBF16PS: pairs of bf16 products summed in fp32); the ``avx512`` variant is the same source
without them (bf16 widened to fp32, fp32 FMAs). Both are timed here on the same bf16 tensors
at the default model's shapes (SmolLM2-135M: hidden 576, intermediate 1536, q 576 / kv 192),
decode and prefill, alternating the two variants repetition by repetition (the machine is
shared and noisy: each figure is the median of ``--reps`` alternating repetitions, and only
ratios within this run are reported):

- ``sgmv``: the LoRA shrink + expand kernel (``lora_sgmv``) per fused projection, ranks 8 /
  16 / 32, decode (16 tokens over 4 adapters; 4 tokens of 4 adapters, one each: there the
  adapters' weights, read from cache, bound the time) and a prefill chunk (64 tokens of one
  adapter);
- ``wq``: the weight-only int4 / int8 linear (``wq_linear``, group 64 or per channel; int8 per channel), bf16
  activations, decode (4 rows) and prefill (256 rows);
- ``paged_attention``: decode rows over a bf16 KV cache (16 sequences of 256 / 1024 tokens):
  the scores by the native bf16 dot product, p . v as before.

``speedup`` = median time of ``avx512`` / median time of ``avx512bf16`` (> 1: the bf16 path is
faster). Writes ``bench/results/bf16_kernels.json`` with the CPU's name.

    python -m bench.bf16_kernels [--reps 7] [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench.common import cpu_name, has_avx512_bf16, write_json
from loramux.engine.model.kernels import loader

PROJ = {  # name -> (K, slice widths): the fused projections of one SmolLM2-135M layer
    "qkv": (576, (576, 192, 192)),
    "o": (576, (576,)),
    "gate_up": (576, (1536, 1536)),
    "down": (1536, (576,)),
}
FP32_PATH, BF16_PATH = "avx512", "avx512bf16"


CLOCK = time.perf_counter
"""The clock of :func:`_time`: this thread's CPU time when the kernels run on one thread (the
time other jobs of a shared machine take the core away is not counted), else wall time."""


def _time(fn, iters: int) -> float:
    """Seconds per call of ``fn`` over ``iters`` calls (after one warm-up call)."""
    fn()
    t0 = CLOCK()
    for _ in range(iters):
        fn()
    return (CLOCK() - t0) / iters


def compare(fn, reps: int, iters: int) -> dict:
    """``fn`` under each variant, alternating, ``reps`` times: medians (µs) and the speedup."""
    times: dict[str, list[float]] = {FP32_PATH: [], BF16_PATH: []}
    try:
        for _ in range(reps):
            for isa in (FP32_PATH, BF16_PATH):
                loader.select_isa(isa)
                times[isa].append(_time(fn, iters))
    finally:
        loader.select_isa("auto")
    med = {isa: statistics.median(t) for isa, t in times.items()}
    return {"fp32_fma_us": round(med[FP32_PATH] * 1e6, 2), "bf16_us": round(med[BF16_PATH] * 1e6, 2),
            "speedup": round(med[FP32_PATH] / med[BF16_PATH], 3)}


def sgmv_case(proj: str, rank: int, tokens: int, adapters: int):
    """A ``lora_sgmv`` call of bf16 x / slots / y: ``tokens`` split in runs over ``adapters``."""
    K, widths = PROJ[proj]
    S, N = len(widths), sum(widths)
    g = torch.Generator().manual_seed(0)
    a = (torch.randn(adapters, S, rank, K, generator=g) * 0.05).bfloat16()
    b = torch.zeros(adapters, S * rank, N)
    offs = [0]
    for s, w in enumerate(widths):
        b[:, s * rank : (s + 1) * rank, offs[-1] : offs[-1] + w] = torch.randn(adapters, rank, w, generator=g) * 0.05
        offs.append(offs[-1] + w)
    b = b.bfloat16()
    x = torch.randn(tokens, K, generator=g).bfloat16()
    y = torch.zeros(tokens, N, dtype=torch.bfloat16)
    per = tokens // adapters
    runs = torch.tensor([[i * per, (i + 1) * per if i < adapters - 1 else tokens, i] for i in range(adapters)])
    ranks = torch.full((adapters,), rank, dtype=torch.long)
    off_t = torch.tensor(offs)
    return lambda: torch.ops.loramux.lora_sgmv(y, x, a, b, runs, ranks, off_t)


def wq_case(K: int, N: int, bits: int, group: int, rows: int):
    """A ``wq_linear`` call on random packed weights (the kernel layout) and bf16 x."""
    g = torch.Generator().manual_seed(1)
    Kp = (K + 31) // 32 * 32
    G = K // group if group else 1
    w = torch.randint(0, 256, (N, Kp * bits // 8), generator=g, dtype=torch.uint8)
    scale = torch.rand(N, G, generator=g) * 0.01
    zero = torch.full((N, G), 8.0 if bits == 4 else 0.0)
    x = torch.randn(rows, K, generator=g).bfloat16()
    return lambda: torch.ops.loramux.wq_linear(x, w, scale, zero, None, bits, K, group, torch.bfloat16)


def attention_case(seqs: int, ctx: int, block: int = 16):
    """A decode ``paged_attention`` call: ``seqs`` rows, each over ``ctx`` cached bf16 keys
    (9 query heads over 3 KV heads of 64, as the default model)."""
    g = torch.Generator().manual_seed(2)
    H, Hkv, D = 9, 3, 64
    width = (ctx + block - 1) // block
    tables = torch.randperm(seqs * width, generator=g).int().view(seqs, width).contiguous()
    k_cache = torch.randn(seqs * width * block, Hkv, D, generator=g).bfloat16()
    v_cache = torch.randn(seqs * width * block, Hkv, D, generator=g).bfloat16()
    q = torch.randn(seqs, H, D, generator=g).bfloat16()
    out = torch.empty(seqs, H * D, dtype=torch.bfloat16)
    rows, ones, lens = torch.arange(seqs).int(), torch.ones(seqs).int(), torch.full((seqs,), ctx).int()
    return lambda: torch.ops.loramux.paged_attention(q, k_cache, v_cache, out, tables, rows, ones, lens, block,
                                                     D**-0.5, 0, 0.0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=7, help="alternating repetitions per case")
    ap.add_argument("--quick", action="store_true", help="fewer cases and calls (a smoke run)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (1: the per-core kernel speed, free of OpenMP waits on a shared machine)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    global CLOCK
    CLOCK = time.thread_time if args.threads == 1 else time.perf_counter
    if not (has_avx512_bf16() and BF16_PATH in loader.isas()):
        print(f"this CPU ({cpu_name()}) does not run the {BF16_PATH} kernels ({loader.isas()}): nothing to compare")
        return 0
    ranks = (16,) if args.quick else (8, 16, 32)
    iters = 20 if args.quick else 100
    sgmv = []
    for phase, tokens, adapters in (("decode", 16, 4), ("decode_1_per_adapter", 4, 4), ("prefill", 64, 1)):
        for rank in ranks:
            for proj in PROJ:
                row = {"phase": phase, "proj": proj, "rank": rank, "tokens": tokens, "adapters": adapters,
                       **compare(sgmv_case(proj, rank, tokens, adapters), args.reps, iters)}
                sgmv.append(row)
                print("sgmv", row, flush=True)
    wq = []
    for phase, rows in (("decode", 4), ("prefill", 256)):
        for bits, group in ((4, 64), (4, 0), (8, 0)):
            for proj, (K, N) in {"gate_up": (576, 3072), "down": (1536, 576)}.items():
                row = {"phase": phase, "proj": proj, "bits": bits, "group": group, "rows": rows, "K": K, "N": N,
                       **compare(wq_case(K, N, bits, group, rows), args.reps, max(iters // (rows // 4), 5))}
                wq.append(row)
                print("wq", row, flush=True)
    attention = []
    for seqs, ctx in ((16, 256), (16, 1024)):
        row = {"phase": "decode", "seqs": seqs, "ctx": ctx, **compare(attention_case(seqs, ctx), args.reps, iters // 4)}
        attention.append(row)
        print("attention", row, flush=True)
    path = write_json("bf16_kernels", {
        "cpu": cpu_name(), "dtype": "bfloat16", "threads": args.threads, "reps": args.reps,
        "clock": "thread CPU time" if args.threads == 1 else "wall",
        "compared": f"{FP32_PATH} (fp32 FMAs on widened bf16) / {BF16_PATH} (VDPBF16PS)",
        "sgmv": sgmv, "wq_linear": wq, "paged_attention": attention,
    })
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
