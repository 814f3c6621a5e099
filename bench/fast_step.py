"""The fast step on a realistic serving shape: new path ÷ old path in the same run.

Workload (the issue's shape, reduced for a shared 2-core machine): ``--num-prompts``
requests arriving as a Poisson process (``--rate`` req/s), each a shared
``--prefix-len``-token system prompt + ``--min-len``..``--max-len`` random tokens,
``--new-tokens`` generated (greedy, ``ignore_eos``); once with the base model, once over
4 adapters (ranks 8/16, all 7 projections, round-robin). The engine is stepped in this
process (no HTTP): arrivals are admitted between steps at their arrival time.

Paths: ``old`` = every part on torch ops (``--enforce-eager`` small ops, the torch attention
that gathers each context then runs SDPA, LoRA as GEMMs; ``LORAMUX_CPU_KERNELS=0``), ``new``
= the defaults (fused small ops, the C attention kernel reading the paged cache in place,
the LoRA SGMV kernel). Reports per run output tok/s, TTFT p50, TPOT
p50, output tokens per CPU-second (robust on a shared machine with ``--threads 1``), and
the ratios new ÷ old and LoRA ÷ base. ``--profile`` adds a torch.profiler
breakdown of steps 3-8 of each run. Writes bench/results/fast_step.json and .png
(``--uniform``: fast_step_uniform_<dtype>.*).

    python -m bench.fast_step                 # default model, bf16, ~2-3 minutes
    python -m bench.fast_step --quick         # fewer, shorter requests
    python -m bench.fast_step --uniform --dtype float32   # the uniform shape, no regression
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench.common import RESULTS, bench_parser, make_engine, setup, write_json
from bench.lora_throughput import make_adapters

# old: every part of the step on torch ops (eager small ops, gather + SDPA attention, LoRA
# GEMMs; LORAMUX_CPU_KERNELS=0 turns off the C kernels); new: the defaults; nobudget: the
# defaults without the step-time budget (``--paths new,nobudget`` shows what it costs).
PATHS = {"old": {"attention_backend": "torch", "enforce_eager": True, "cpu_kernels": "0"},
         "new": {"attention_backend": "auto", "enforce_eager": False, "cpu_kernels": "1"},
         "nobudget": {"enable_step_budget": False}}


def make_workload(tok, args) -> tuple[list[list[int]], list[float]]:
    g = torch.Generator().manual_seed(0)
    lo, hi = 1000, min(len(tok), 40000)
    prefix = torch.randint(lo, hi, (args.prefix_len,), generator=g).tolist()
    prompts, arrivals, t = [], [], 0.0
    for _ in range(args.num_prompts):
        n = int(torch.randint(args.min_len, args.max_len + 1, (1,), generator=g))
        prompts.append(prefix + torch.randint(lo, hi, (n,), generator=g).tolist())
        t += float(torch.empty(1).exponential_(args.rate, generator=g))
        arrivals.append(t)
    return prompts, arrivals


def run(model, prompts, arrivals, loras, args, profile: bool, cpu_kernels: str = "1", **options) -> dict:
    os.environ["LORAMUX_CPU_KERNELS"] = cpu_kernels  # read when the engine picks its paths
    from loramux.engine.sampling_params import SamplingParams

    eng = make_engine(model=str(model), dtype=args.dtype, max_model_len=1024, max_num_seqs=64,
                      enable_lora=bool(loras), **({"max_loras": 4} if loras else {}), **options)
    params = SamplingParams(temperature=0, max_tokens=args.new_tokens, min_tokens=args.new_tokens,
                            ignore_eos=True)
    for i, lr in enumerate(loras or [None]):  # warm-up: adapters resident, prefix cached
        eng.add_request(f"warm{i}", {"prompt_token_ids": prompts[0][: args.prefix_len + 1]},
                        SamplingParams(temperature=0, max_tokens=2), lora_request=lr)
    while eng.has_unfinished_requests():
        eng.step()
    first: dict[str, float] = {}
    done: dict[str, float] = {}
    t0, c0 = time.perf_counter(), time.process_time()
    nxt = 0
    prof = None
    steps = 0
    while nxt < len(prompts) or eng.has_unfinished_requests():
        now = time.perf_counter() - t0
        while nxt < len(prompts) and arrivals[nxt] <= now:
            lr = loras[nxt % len(loras)] if loras else None
            eng.add_request(str(nxt), {"prompt_token_ids": prompts[nxt]}, params, lora_request=lr)
            nxt += 1
        if not eng.has_unfinished_requests():
            time.sleep(max(0.0, arrivals[nxt] - now))
            continue
        if profile and steps == 2:
            prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            prof.__enter__()
        outs = eng.step()
        steps += 1
        if prof is not None and steps == 8:
            prof.__exit__(None, None, None)
        t = time.perf_counter() - t0
        for o in outs:
            if o.request_id.startswith("warm"):
                continue
            first.setdefault(o.request_id, t)
            if o.finished:
                done[o.request_id] = t
    wall = time.perf_counter() - t0
    cpu = time.process_time() - c0
    ttft = [first[str(i)] - arrivals[i] for i in range(len(prompts))]
    tpot = [(done[str(i)] - first[str(i)]) / max(1, args.new_tokens - 1) for i in range(len(prompts))]
    res = {"tok_s": len(prompts) * args.new_tokens / wall, "ttft_p50_ms": 1e3 * statistics.median(ttft),
           "tpot_p50_ms": 1e3 * statistics.median(tpot), "wall_s": wall, "steps": steps,
           "cpu_s": cpu, "tok_per_cpu_s": len(prompts) * args.new_tokens / cpu}
    if prof is not None:
        res["profile_top"] = [
            {"op": e.key, "self_cpu_ms": e.self_cpu_time_total / 1e3, "calls": e.count}
            for e in sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:15]
        ]
    return res


def main() -> None:
    ap = bench_parser(__doc__, quick="8 prompts, 16 new tokens")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--rate", type=float, default=1.5)
    ap.add_argument("--prefix-len", type=int, default=128)
    ap.add_argument("--min-len", type=int, default=150)
    ap.add_argument("--max-len", type=int, default=300)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--paths", default="old,new")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--uniform", action="store_true",
                    help="the uniform offline shape instead: all arrive at once, no shared prefix, "
                         "32-token prompts, 32 new tokens (results in fast_step_uniform_<dtype>.*)")
    args = ap.parse_args()
    if args.quick:
        args.num_prompts, args.new_tokens, args.min_len, args.max_len = 8, 16, 64, 160
    name = "fast_step"
    if args.uniform:
        args.rate, args.prefix_len, args.min_len, args.max_len, args.new_tokens = 1e9, 0, 32, 32, 32
        name = f"fast_step_uniform_{args.dtype}"
    model, tok = setup(args)
    from loramux.engine.lora_request import LoRARequest

    prompts, arrivals = make_workload(tok, args)
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        paths = make_adapters(model, Path(tmp), 4)
        loras = [LoRARequest(f"a{i}", i + 1, str(p)) for i, p in enumerate(paths)]
        for path in args.paths.split(","):
            for kind, lr in (("base", None), ("lora", loras)):
                key = f"{path}/{kind}"
                results[key] = run(model, prompts, arrivals, lr, args, args.profile, **PATHS[path])
                r = results[key]
                print(f"{key:10s} {r['tok_s']:7.1f} tok/s  TTFT p50 {r['ttft_p50_ms']:7.1f} ms  "
                      f"TPOT p50 {r['tpot_p50_ms']:6.1f} ms  {r['tok_per_cpu_s']:6.1f} tok/cpu-s",
                      flush=True)
    ratios = {}
    for path in args.paths.split(","):
        b, lo = results[f"{path}/base"], results[f"{path}/lora"]
        ratios[f"{path}: lora/base tok_s"] = lo["tok_s"] / b["tok_s"]
        ratios[f"{path}: lora/base TPOT"] = lo["tpot_p50_ms"] / b["tpot_p50_ms"]
        ratios[f"{path}: lora/base tok/cpu-s"] = lo["tok_per_cpu_s"] / b["tok_per_cpu_s"]
    if "old/base" in results and "new/base" in results:
        for kind in ("base", "lora"):
            o, n = results[f"old/{kind}"], results[f"new/{kind}"]
            ratios[f"{kind}: new/old tok_s"] = n["tok_s"] / o["tok_s"]
            ratios[f"{kind}: old/new TPOT"] = o["tpot_p50_ms"] / n["tpot_p50_ms"]
            ratios[f"{kind}: old/new TTFT"] = o["ttft_p50_ms"] / n["ttft_p50_ms"]
            ratios[f"{kind}: new/old tok/cpu-s"] = n["tok_per_cpu_s"] / o["tok_per_cpu_s"]
    for k, v in ratios.items():
        print(f"{k:28s} {v:5.2f}")
    out = write_json(name, {"workload": vars(args), "results": results, "ratios": ratios})
    print(f"wrote {out}")
    _plot(results, name)


def _plot(results: dict, name: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    names = list(results)
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.5))
    for ax, key, label in zip(axes, ("tok_s", "ttft_p50_ms", "tpot_p50_ms"),
                              ("output tok/s", "TTFT p50 (ms)", "TPOT p50 (ms)"), strict=True):
        ax.bar(names, [results[n][key] for n in names], color=["#999", "#bbb", "#37a", "#5ad"][: len(names)])
        ax.set_title(label)
        ax.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    fig.savefig(RESULTS / f"{name}.png", dpi=100)


if __name__ == "__main__":
    main()
