"""Many adapters, few slots: N adapters in use against the all-resident run, same process.

Workload (the issue's, tried with ``vllm bench serve``): Poisson arrivals (``--rate``),
prompts of ``--min-prompt``..``--max-prompt`` random tokens, ``--min-out``..``--max-out``
output tokens with ``ignore_eos``, each request to an adapter drawn uniformly or with a
power law (Zipf ``--alpha``, S-LoRA's skew); adapters of ranks 8/16/32 on all seven
projections, cold on disk at the start. The same arrivals, prompts and lengths in every
configuration:

* ``N4``: 4 adapters, default flags (all resident) — the baseline;
* ``N32``: 32 adapters, uniform, default flags (capacity derived from memory);
* ``N128-zipf``: 128 adapters, skewed, default flags;
* ``N32-max4``: 32 adapters, uniform, ``--max-loras 4 --max-cpu-loras 16`` (vLLM's meaning).

Reports output tokens/s, TTFT and TPOT p50/p99, wall time and adapter loads per 1k requests
per tier (store / disk → CPU / CPU → slot), and the ratios to ``N4`` against the issue's
goals. Writes bench/results/many_adapters.json and .png. Runs through the AsyncEngine (no
HTTP), on the default model in bfloat16; ``--quick`` uses a tiny random model (seconds).

    python -m bench.many_adapters                                  # the issue's sizes
    python -m bench.many_adapters --requests 24 --rate 2 --max-out 48   # a shorter run
"""

from __future__ import annotations

import asyncio
import gc
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench.common import bench_parser, make_async_engine, peak_rss_mb, setup, write_json
from bench.source_tree import load_test_support

ALL_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
RANKS = (8, 16, 32)
CONFIGS = {
    "N4": dict(adapters=4, skew=False, lora={}),
    "N32": dict(adapters=32, skew=False, lora={}),
    "N128-zipf": dict(adapters=128, skew=True, lora={}),
    "N32-max4": dict(adapters=32, skew=False, lora=dict(max_loras=4, max_cpu_loras=16)),
}
GOALS = {  # the issues': ratio to N4 (tok/s at least, TTFT p50 / p99 at most)
    "N32": {"tok_s": 0.85, "ttft_p50": 2.0, "ttft_p99": 2.0},
    "N128-zipf": {"tok_s": 0.8},
    "N32-max4": {"tok_s": 0.7, "ttft_p50": 5.0},
}


def pct(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(round(p / 100 * (len(s) - 1))))]


def workload(args, vocab: int) -> list[dict]:
    """Arrival, prompt, output length and a uniform draw ``u`` in [0, 1) per request (the
    adapter is picked from ``u`` per configuration, so all share one random stream)."""
    rng = random.Random(args.seed)
    t, reqs = 0.0, []
    for _ in range(args.requests):
        t += rng.expovariate(args.rate)
        n = rng.randint(args.min_prompt, args.max_prompt)
        reqs.append(dict(arrival=t, prompt=[rng.randrange(100, vocab) for _ in range(n)],
                         max_tokens=rng.randint(args.min_out, args.max_out), u=rng.random()))
    return reqs


def pick(u: float, n: int, skew: bool, alpha: float) -> int:
    """Adapter index for the draw ``u``: uniform, or power law ``p(i) ∝ (i + 1) ** -alpha``."""
    if not skew:
        return min(int(u * n), n - 1)
    weights = [(i + 1) ** -alpha for i in range(n)]
    total, acc = sum(weights), 0.0
    for i, w in enumerate(weights):
        acc += w / total
        if u < acc:
            return i
    return n - 1


def make_adapters(model: Path, root: Path, count: int) -> list[Path]:
    """``count`` random adapters under ``root``, reusing the ones a previous run wrote."""
    write_random_adapter = load_test_support("adapters").write_random_adapter
    paths = []
    for i in range(count):
        path = root / f"a{i}"
        if not (path / "adapter_model.safetensors").is_file():
            write_random_adapter(model, path, r=RANKS[i % len(RANKS)], seed=i, std=0.02,
                                 target_modules=ALL_MODULES, lora_alpha=16.0,
                                 dtype=torch.bfloat16)
        paths.append(path)
    return paths


async def run_config(engine, reqs: list[dict], adapters: list[Path], cfg: dict, alpha: float) -> dict:
    from loramux.engine import LoRARequest, SamplingParams

    start = time.perf_counter()
    records: list[dict] = []

    async def one(i: int, r: dict) -> None:
        await asyncio.sleep(max(0.0, start + r["arrival"] - time.perf_counter()))
        k = pick(r["u"], cfg["adapters"], cfg["skew"], alpha)
        lora = LoRARequest(f"a{k}", k + 1, str(adapters[k]))
        params = SamplingParams(temperature=0, max_tokens=r["max_tokens"], ignore_eos=True)
        sent, stamps, last = time.perf_counter(), [], None
        async for out in engine.generate({"prompt_token_ids": r["prompt"]}, params, f"r{i}", lora):
            n = len(out.outputs[0].token_ids)
            stamps += [time.perf_counter()] * (n - len(stamps))
            last = out
        tpot = (stamps[-1] - stamps[0]) / (len(stamps) - 1) if len(stamps) > 1 else None
        records.append(dict(ttft=stamps[0] - sent, tpot=tpot, tokens=len(stamps), done=stamps[-1],
                            phases=last.metrics.timing(), adapter=k, prompt=len(r["prompt"])))

    await asyncio.gather(*(one(i, r) for i, r in enumerate(reqs)))
    wall = max(r["done"] for r in records) - start
    ttft = [r["ttft"] for r in records]
    tpot = [r["tpot"] for r in records if r["tpot"] is not None]
    return {
        "output_tok_s": sum(r["tokens"] for r in records) / wall,
        "ttft_s": {"p50": pct(ttft, 50), "p99": pct(ttft, 99)},
        "tpot_s": {"p50": pct(tpot, 50), "p99": pct(tpot, 99)},
        "wall_s": wall,
        "ttft_tail": tail_phases(records),
    }


def tail_phases(records: list[dict], share: float = 0.1) -> dict:
    """Where the slowest ``share`` of first tokens waited (mean seconds per phase of
    ``RequestMetrics.timing``), beside the same for every request: the per-request trace
    that tells admission, adapter loads and prefill apart."""
    done = [r for r in records if r["phases"] is not None]
    tail = sorted(done, key=lambda r: r["ttft"])[-max(1, int(len(done) * share)):]

    def mean(rs: list[dict]) -> dict:
        return {p: statistics.mean(r["phases"][p] for r in rs) for p in ("queue", "adapter_load", "prefill")}

    return {"tail": mean(tail), "all": mean(done), "tail_count": len(tail),
            "tail_prompts": [r["prompt"] for r in tail]}


async def warm_up(engine, prompt: list[int]) -> None:
    from loramux.engine import SamplingParams

    async for _ in engine.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=2),
                                   "warm-up", None):
        pass


def plot(results: dict, ratios: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    axes[0].bar(names, [results[n]["output_tok_s"] for n in names])
    axes[0].set_title("output tokens/s")
    for j, p in enumerate(("p50", "p99")):
        axes[1].bar([i + j * 0.4 for i in range(len(names))],
                    [results[n]["ttft_s"][p] for n in names], 0.4, label=f"TTFT {p}")
    axes[1].set_xticks([i + 0.2 for i in range(len(names))], names)
    axes[1].set_title("TTFT (s)")
    axes[1].legend()
    rn = list(ratios)
    axes[2].bar([i - 0.2 for i in range(len(rn))], [ratios[n]["tok_s"] for n in rn], 0.4,
                label="tok/s ÷ N4")
    axes[2].bar([i + 0.2 for i in range(len(rn))], [ratios[n]["ttft_p50"] for n in rn], 0.4,
                label="TTFT p50 ÷ N4")
    axes[2].set_xticks(range(len(rn)), rn)
    axes[2].axhline(1.0, color="gray", lw=0.5)
    axes[2].set_title("ratios to the all-resident run")
    axes[2].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def measure(engine, reqs: list[dict], adapters: list[Path], cfg: dict, alpha: float) -> dict:
    """Warm the engine up (no adapter), run the workload, add the adapter load counts."""
    manager = engine.engine.lora_manager
    asyncio.run(warm_up(engine, reqs[0]["prompt"]))  # first-use costs
    res = asyncio.run(run_config(engine, reqs, adapters, cfg, alpha))
    stats = manager.load_stats
    res["max_loras"] = manager.max_loras
    res["loads_per_1k_requests"] = {t: 1000 * n / len(reqs) for t, n in stats.loads.items()}
    res["load_ms_avg"] = {t: 1000 * stats.seconds[t] / n for t, n in stats.loads.items() if n}
    res["evictions"] = manager.num_evictions
    res["preemptions"] = engine.engine.scheduler.num_preemptions
    engine.shutdown()
    gc.collect()
    return res


def engine_for(args, model: Path, lora: dict):
    return make_async_engine(model=str(model), dtype=args.dtype, device="cpu",
                             max_model_len=args.max_prompt + args.max_out + 16,
                             kv_cache_memory=1 << 30, max_num_seqs=64, enable_lora=True,
                             max_lora_rank=max(RANKS), **lora)


def main() -> None:
    ap = bench_parser(__doc__.splitlines()[0], quick="a tiny random model (seconds)")
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--rate", type=float, default=1.0, help="Poisson arrivals per second")
    ap.add_argument("--min-prompt", type=int, default=128)
    ap.add_argument("--max-prompt", type=int, default=384)
    ap.add_argument("--min-out", type=int, default=32)
    ap.add_argument("--max-out", type=int, default=96)
    ap.add_argument("--alpha", type=float, default=1.0, help="power-law skew of N128-zipf")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--repeat", type=int, default=1,
                    help="alternate the configurations this many times; ratios are medians")
    ap.add_argument("--adapter-dir", default=str(Path.home() / ".cache/loramux/bench-adapters"),
                    help="where the random adapters are kept between runs ('' = a temp dir)")
    args = ap.parse_args()
    model, _ = setup(args)
    names = args.configs.split(",")
    if "N4" not in names:
        names.insert(0, "N4")  # the baseline is always measured in the same run
    with tempfile.TemporaryDirectory() as tmp:
        if args.quick:
            make_tiny_llama = load_test_support("tiny_models").make_tiny_llama
            model = make_tiny_llama(Path(tmp) / "tiny", model)
        root = Path(args.adapter_dir) if args.adapter_dir and not args.quick else Path(tmp)
        adapters = make_adapters(model, root, max(CONFIGS[n]["adapters"] for n in names))
        reqs = None
        runs: dict[str, list[dict]] = {n: [] for n in names}
        for rep in range(args.repeat):  # N4, N32, ..., N4, N32, ...: a shared machine's load
            for name in names:          # changes hit every configuration alike
                engine = engine_for(args, model, CONFIGS[name]["lora"])
                reqs = reqs or workload(args, engine.engine.model.dims.vocab_size)
                res = measure(engine, reqs, adapters, CONFIGS[name], args.alpha)
                runs[name].append(res)
                print(f"[{rep}] {name:10s} slots {res['max_loras']:3d}  "
                      f"{res['output_tok_s']:6.1f} tok/s  TTFT p50/p99 {res['ttft_s']['p50']:.2f}/"
                      f"{res['ttft_s']['p99']:.2f} s  TPOT p50 {res['tpot_s']['p50'] * 1e3:.0f} ms"
                      f"  wall {res['wall_s']:.0f} s  loads/1k {res['loads_per_1k_requests']}",
                      flush=True)
                tail = res["ttft_tail"]
                print("           TTFT tail (slowest 10%) s: " + ", ".join(
                    f"{p} {tail['tail'][p]:.2f} (all {tail['all'][p]:.2f})" for p in tail["tail"]),
                    flush=True)
    results = {n: runs[n][-1] for n in names}
    ratios = {}
    for name in names:
        if name == "N4":
            continue
        pairs = list(zip(runs[name], runs["N4"], strict=True))  # each against its own rep's N4
        r = {"tok_s": statistics.median(a["output_tok_s"] / b["output_tok_s"] for a, b in pairs),
             "ttft_p50": statistics.median(a["ttft_s"]["p50"] / b["ttft_s"]["p50"]
                                           for a, b in pairs),
             "ttft_p99": statistics.median(a["ttft_s"]["p99"] / b["ttft_s"]["p99"]
                                           for a, b in pairs)}
        goal = GOALS.get(name, {})
        r["meets_goal"] = (r["tok_s"] >= goal.get("tok_s", 0.0)
                           and r["ttft_p50"] <= goal.get("ttft_p50", float("inf"))
                           and r["ttft_p99"] <= goal.get("ttft_p99", float("inf")))
        ratios[name] = r
    print("ratios to N4", ratios)
    payload = {"args": vars(args), "results": results, "runs": runs, "ratios": ratios,
               "goals": GOALS,
               "peak_rss_mb": peak_rss_mb()}
    out = write_json("many_adapters" + ("_quick" if args.quick else ""), payload)
    plot(results, ratios, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
