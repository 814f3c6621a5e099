"""LoRA shrink+expand cost relative to the base projection matmul, per number of adapters.

CPU (default): torch backend, SmolLM2-135M projections (hidden 576, intermediate 1536,
q 576 / kv 192), ranks 8 and 16, decode (T=32) and prefill (T=1024), 2 threads.
``--clock cpu`` times one thread by its own CPU time instead (a stable figure when other
jobs share the machine). ``--device cuda``: Triton backend in bf16 on Llama-7B projections (hidden 4096,
intermediate 11008, rank 16), 1-64 adapters.

For every (mode, rank, adapters) it prints ``time(shrink + expand) / time(x @ W.T)`` per
projection and for the whole layer (sum over projections), and writes
``bench/results/lora_kernels.json`` (one entry per device) and ``lora_kernels.png``.

    python -m bench.lora_kernels [--device cpu|cuda] [--dtype bf16|fp32] [--clock wall|cpu] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"

# name -> (K, slice widths); the fused projections of one Llama decoder layer
SMOLLM2 = {
    "qkv": (576, (576, 192, 192)),
    "o": (576, (576,)),
    "gate_up": (576, (1536, 1536)),
    "down": (1536, (576,)),
}
LLAMA7B = {
    "qkv": (4096, (4096, 4096, 4096)),
    "o": (4096, (4096,)),
    "gate_up": (4096, (11008, 11008)),
    "down": (11008, (4096,)),
}
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}


_clock = time.perf_counter  # replaced by time.thread_time under --clock cpu


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _batch_size(fn, device: torch.device, min_time: float) -> int:
    """Calls per timed batch so that one batch takes about ``min_time`` seconds."""
    fn()
    _sync(device)
    t0, n = _clock(), 0
    while _clock() - t0 < min_time / 4 and n < 1000:
        fn()
        n += 1
        _sync(device)
    per_call = max((_clock() - t0) / max(n, 1), 1e-9)
    return max(1, int(min_time / per_call))


def _time_batch(fn, device: torch.device, inner: int) -> float:
    _sync(device)
    t0 = _clock()
    for _ in range(inner):
        fn()
    _sync(device)
    return (_clock() - t0) / inner


def time_pair(base, lora, device: torch.device, repeats: int, min_time: float) -> dict:
    """Median seconds per call of ``base`` and ``lora`` and the median of their per-repeat
    ratio; the two are timed alternately so both see the same machine load."""
    nb, nl = _batch_size(base, device, min_time), _batch_size(lora, device, min_time)
    tb, tl_ = [], []
    for _ in range(repeats):
        tb.append(_time_batch(base, device, nb))
        tl_.append(_time_batch(lora, device, nl))
    ratios = [lo / ba for lo, ba in zip(tl_, tb, strict=True)]
    return {
        "base_s": statistics.median(tb),
        "lora_s": statistics.median(tl_),
        "ratio": statistics.median(ratios),
        "ratio_of_mins": min(tl_) / min(tb),  # least disturbed by other load on the machine
    }


def time_fn(fn, device: torch.device, repeats: int, min_time: float) -> float:
    """Median seconds per call of ``fn``."""
    inner = _batch_size(fn, device, min_time)
    return statistics.median(_time_batch(fn, device, inner) for _ in range(repeats))


def token_slots(num_tokens: int, num_adapters: int, seed: int = 0) -> list[int]:
    """Tokens spread evenly over the adapters, interleaved as requests would be."""
    slots = [i % num_adapters for i in range(num_tokens)]
    random.Random(seed).shuffle(slots)
    return slots


def bench_projection(K, widths, T, rank, n_adapters, num_slots, dtype, device, backend, reps, mt):
    """Timings of the base matmul and of LoRA shrink+expand for one projection."""
    from loramux.engine.lora.meta import LoRABatchMeta
    from loramux.engine.lora.ops import add_lora, lora_expand, lora_shrink

    N = sum(widths)
    offs = [0]
    for w in widths:
        offs.append(offs[-1] + w)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(T, K, generator=g).to(device, dtype)
    w = (torch.randn(N, K, generator=g) / K**0.5).to(device, dtype)
    a = (torch.randn(num_slots, len(widths), rank, K, generator=g) / K**0.5).to(device, dtype)
    b = (torch.randn(num_slots, N, rank, generator=g) / rank**0.5 * 0.01).to(device, dtype)
    scale = torch.full((num_slots,), 2.0, device=device)
    ranks = torch.full((num_slots,), rank, dtype=torch.int64)
    meta = LoRABatchMeta.build(token_slots(T, n_adapters), ranks, device=device)
    y = torch.nn.functional.linear(x, w)

    def base():
        torch.nn.functional.linear(x, w)

    def lora():
        add_lora(y, x, a, b, meta, scale, offs, backend=backend)

    def lora_split():
        v = lora_shrink(x, a, meta, scale, backend=backend)
        lora_expand(v, b, meta, y, offs, backend=backend)

    res = time_pair(base, lora, device, reps, mt)
    res["lora_unfused_s"] = time_fn(lora_split, device, max(3, reps // 2), mt)
    return res


def run(args) -> dict:
    device = torch.device(args.device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            sys.exit(
                "--device cuda: no CUDA device is available (run without it for the CPU bench)"
            )
        from loramux.engine.lora.ops import triton_available

        if not triton_available():
            sys.exit("--device cuda: triton is not installed")
        shapes, ranks, backend = LLAMA7B, (16,), "triton"
        modes = {"decode": 64, "prefill": 1024}
        adapters = (1, 2, 4, 8, 16, 32, 64)
        dtype = DTYPES[args.dtype or "bf16"]
    else:
        torch.set_num_threads(args.threads)
        shapes, ranks, backend = SMOLLM2, (8, 16), "torch"
        modes = {"decode": 32, "prefill": 1024}
        adapters = (1, 2, 4, 8, 16, 32)
        dtype = DTYPES[args.dtype or "bf16"]
        if dtype == torch.float16:
            sys.exit("fp16 matmuls are very slow on CPU; use bf16 or fp32")
    if args.quick:
        adapters = tuple(a for a in adapters if a in (1, 8, 32, 64))
    num_slots = max(adapters)
    reps, mt = (5, 0.01) if args.quick else (9, 0.025)
    load_before = os.getloadavg()[0]

    rows = []
    header = f"{'mode':8} {'T':>5} {'rank':>4} {'adapters':>8} " + " ".join(
        f"{p:>8}" for p in shapes
    )
    print(
        f"device={device} backend={backend} dtype={dtype} threads={torch.get_num_threads()}"
        f" clock={_clock.__name__}"
    )
    print("ratio = time(shrink+expand) / time(base x @ W.T)")
    print(header + f" {'layer':>8} {'layer*':>8}   (* = ratio of fastest repeats)")
    for mode, T in modes.items():
        for rank in ranks:
            for n in adapters:
                per = {
                    name: bench_projection(
                        K, widths, T, rank, n, num_slots, dtype, device, backend, reps, mt
                    )
                    for name, (K, widths) in shapes.items()
                }
                row = dict(mode=mode, T=T, rank=rank, adapters=n, projections=per)
                # layer = sum over projections, each base time weighted by its measured ratio
                base_sum = sum(p["base_s"] for p in per.values())
                row["layer_ratio"] = sum(p["ratio"] * p["base_s"] for p in per.values()) / base_sum
                row["layer_ratio_of_mins"] = (
                    sum(p["ratio_of_mins"] * p["base_s"] for p in per.values()) / base_sum
                )
                rows.append(row)
                cells = " ".join(f"{per[p]['ratio']:8.3f}" for p in shapes)
                print(
                    f"{mode:8} {T:5d} {rank:4d} {n:8d} {cells} {row['layer_ratio']:8.3f}"
                    f" {row['layer_ratio_of_mins']:8.3f}"
                )

    from loramux.engine.lora.meta import LoRABatchMeta

    slot_ranks = torch.full((num_slots,), 16, dtype=torch.int64)
    build_s = {
        mode: time_fn(
            lambda T=T: LoRABatchMeta.build(token_slots(T, num_slots), slot_ranks, device),
            device,
            reps,
            mt,
        )
        for mode, T in modes.items()
    }
    print("meta build per step (s): " + ", ".join(f"{m}={t:.2e}" for m, t in build_s.items()))
    load = max(load_before, os.getloadavg()[0])
    if device.type == "cpu" and load > os.cpu_count() - 0.5:
        print(f"WARNING: load average {load:.1f} on {os.cpu_count()} CPUs: timings are noisy")
    return dict(
        device=str(device),
        device_name=(torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"),
        backend=backend,
        dtype=str(dtype).removeprefix("torch."),
        threads=torch.get_num_threads(),
        torch=torch.__version__,
        meta_build_s=build_s,
        load_avg=[load_before, os.getloadavg()[0]],
        cpu_count=os.cpu_count(),
        results=rows,
    )


def plot(all_results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(
        1, len(all_results), figsize=(6 * len(all_results), 4.5), squeeze=False
    )
    for ax, (_dev, res) in zip(axes[0], sorted(all_results.items()), strict=True):
        series: dict[tuple, list] = {}
        for r in res["results"]:
            series.setdefault((r["mode"], r["T"], r["rank"]), []).append(
                (r["adapters"], r["layer_ratio"])
            )
        for (mode, T, rank), pts in sorted(series.items()):
            pts.sort()
            ax.plot(
                [p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{mode} T={T} r={rank}"
            )
        ax.set_xscale("log", base=2)
        ax.set_xlabel("distinct adapters in the batch")
        ax.set_ylabel("LoRA (shrink+expand) time / base matmul time")
        ax.set_title(
            f"{res['device_name']}: {res['backend']} {res['dtype']}, "
            f"{res['threads']} thread(s), {res.get('clock', 'wall')} clock"
        )
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--dtype", default=None, choices=sorted(DTYPES), help="default bf16")
    p.add_argument("--threads", type=int, default=2, help="CPU threads (default 2)")
    p.add_argument("--quick", action="store_true", help="fewer adapter counts and repeats")
    p.add_argument(
        "--clock",
        default="wall",
        choices=("wall", "cpu"),
        help="cpu: one thread timed by its own CPU time (stable on a busy machine)",
    )
    p.add_argument("--out", type=Path, default=RESULTS / "lora_kernels")
    args = p.parse_args(argv)
    key = args.device
    if args.clock == "cpu":
        if args.device != "cpu":
            p.error("--clock cpu is for the CPU bench")
        global _clock
        _clock = time.thread_time
        args.threads = 1
        key = "cpu_thread_time"

    res = run(args)
    out_json = args.out.with_suffix(".json")
    out_json.parent.mkdir(parents=True, exist_ok=True)
    all_results = json.loads(out_json.read_text()) if out_json.exists() else {}
    res["clock"] = args.clock
    all_results[key] = res
    out_json.write_text(json.dumps(all_results, indent=2) + "\n")
    plot(all_results, args.out.with_suffix(".png"))
    print(f"wrote {out_json} and {args.out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
