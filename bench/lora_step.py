"""One mixed engine step with and without its adapters: what the LoRA costs, and where.

The serving shape of ``bench/fast_step.py`` frozen into single steps: ``--decodes`` decode
rows over 4 adapters (ranks 8/16, all 7 projections, round-robin, as fast_step) plus, in
the mixed step, one ``--chunk``-token prompt chunk of a fifth request on adapter 0. Each
step is captured from the engine's own scheduler, then its forward pass is replayed (same
rows, same KV positions) alternately with the adapters' hook prepared (``lora``) and
cleared (``base``: the same attention and projections, no LoRA), timed by the thread's
CPU clock (robust on a shared machine). The ratio base ÷ lora of the step's CPU time is
the throughput ratio the engine sees on that step. ``--profile`` prints a torch.profiler
breakdown of the LoRA replays (kernels by name) and a cProfile of the hook's Python side.

    python -m bench.lora_step --dtype float32        # ~1 minute, writes results/lora_step_<dtype>.json + .png
    LORAMUX_CPU_ISA=avx2 python -m bench.lora_step   # the CI machines' kernel variant
"""

from __future__ import annotations

import cProfile
import io
import os
import pstats
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench.common import RESULTS, bench_parser, make_engine, setup, write_json
from bench.lora_throughput import make_adapters


def capture_steps(eng, loras, args) -> dict:
    """Drive the engine to (decode-only, mixed decode + chunk) steps; return their plans."""
    from loramux.engine.sampling_params import SamplingParams

    g = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=0, max_tokens=1000, min_tokens=1000, ignore_eos=True)
    for i in range(args.decodes):
        ids = torch.randint(1000, 30000, (args.prompt_len,), generator=g).tolist()
        eng.add_request(f"d{i}", {"prompt_token_ids": ids}, params, lora_request=loras[i % len(loras)])
    plans: dict = {}
    real = eng.runner.execute

    def spy(plan):
        rows = plan.scheduled
        if rows and all(not r.is_prefill for r in rows) and len(rows) == args.decodes:
            plans.setdefault("decode", plan)
        elif any(r.is_prefill and r.num_new_tokens == args.chunk for r in rows) and len(rows) > args.decodes:
            plans.setdefault("mixed", plan)
        return real(plan)

    eng.runner.execute = spy
    while "decode" not in plans:
        eng.step()
    long = torch.randint(1000, 30000, (args.chunk * 4,), generator=g).tolist()
    eng.add_request("p", {"prompt_token_ids": long}, params, lora_request=loras[0])
    for _ in range(50):
        if "mixed" in plans:
            break
        eng.step()
    eng.runner.execute = real
    return plans


def replay(eng, plan, lora: bool, clock=time.thread_time) -> float:
    """One forward pass of ``plan``'s rows; returns its seconds by ``clock`` (default the thread's
    CPU time; wall time where the calls split over threads)."""
    batch = eng.runner.order(plan, eng.lora_manager.slot_of)
    t0 = clock()
    if lora:
        eng.lora_manager.prepare_step(batch.row_lora_keys, batch.num_new_tokens)
    try:
        eng.runner.run_batch(batch, ())
    finally:
        eng.lora_manager.finish_step()
    return clock() - t0


def measure(eng, plan, repeats: int) -> dict:
    for _ in range(2):
        replay(eng, plan, True), replay(eng, plan, False)
    base, lora = [], []
    for _ in range(repeats):  # alternating, so drifts of the machine hit both
        base.append(replay(eng, plan, False))
        lora.append(replay(eng, plan, True))
    b, lo = statistics.median(base), statistics.median(lora)
    return {"base_ms": 1e3 * b, "lora_ms": 1e3 * lo, "lora_extra_ms": 1e3 * (lo - b),
            "base/lora": b / lo, "tokens": sum(r.num_new_tokens for r in plan.scheduled)}


def profile(eng, plan) -> None:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            replay(eng, plan, True)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14))
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(3):
        replay(eng, plan, True)
    pr.disable()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(14)
    print(s.getvalue())


def main() -> None:
    ap = bench_parser(__doc__, dtype="float32", threads=1)
    ap.add_argument("--decodes", type=int, default=16)
    ap.add_argument("--chunk", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    model, _ = setup(args)
    from loramux.engine.lora_request import LoRARequest

    with tempfile.TemporaryDirectory() as tmp:
        paths = make_adapters(model, Path(tmp), 4)
        loras = [LoRARequest(f"a{i}", i + 1, str(p)) for i, p in enumerate(paths)]
        eng = make_engine(model=str(model), dtype=args.dtype, max_model_len=2048, max_num_seqs=64,
                          enable_lora=True, max_loras=4, enable_step_budget=False,
                          max_num_batched_tokens=args.decodes + args.chunk)
        plans = capture_steps(eng, loras, args)
        results = {}
        for name, plan in plans.items():
            results[name] = r = measure(eng, plan, args.repeats)
            print(f"{name:7s} {r['tokens']:4d} tokens  base {r['base_ms']:7.2f} ms  lora {r['lora_ms']:7.2f} ms"
                  f"  LoRA extra {r['lora_extra_ms']:6.2f} ms  base/lora {r['base/lora']:.3f}", flush=True)
            if args.profile:
                profile(eng, plan)
    out = write_json(f"lora_step_{args.dtype}", {
        "workload": vars(args), "isa": os.environ.get("LORAMUX_CPU_ISA", "auto"), "results": results})
    print(f"wrote {out}")
    plot(results, RESULTS / f"lora_step_{args.dtype}.png")


def plot(results: dict, path: Path) -> None:
    """Bars: each captured step's CPU ms with and without its adapters."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    names = list(results)
    fig, ax = plt.subplots(figsize=(6, 3.5))
    xs = range(len(names))
    ax.bar([x - 0.2 for x in xs], [results[n]["base_ms"] for n in names], 0.4, label="base", color="#999")
    ax.bar([x + 0.2 for x in xs], [results[n]["lora_ms"] for n in names], 0.4, label="4 adapters", color="#37a")
    for x, n in zip(xs, names, strict=True):
        ax.text(x + 0.2, results[n]["lora_ms"], f"{results[n]['base/lora']:.2f}x", ha="center", va="bottom")
    ax.set_xticks(list(xs), [f"{n} ({results[n]['tokens']} tok)" for n in names])
    ax.set_ylabel("CPU ms per step")
    ax.set_title("one step, base vs LoRA (label: base/lora)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
