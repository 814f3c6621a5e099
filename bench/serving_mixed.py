"""Mixed serving workload through the AsyncEngine: chunked prefill and prefix caching, on ÷ off.

Workload (same requests, same arrival times for every configuration): Poisson arrivals,
prompts of ~50..1,500 tokens of which those longer than a system prompt start with
their adapter's shared ~512-token system prompt, requests spread over several adapters (and
the base model), ``ignore_eos`` outputs of 64..256 tokens. Reports TTFT and inter-token
latency p50/p90/p99 (and ITL p99 ÷ TPOT p50) and output tokens/s per configuration, the ratios on ÷ off, and the
TTFT of requests whose system prompt was already cached against uncached ones. Writes
bench/results/serving_mixed.json and .png.

    python -m bench.serving_mixed [--requests 12] [--rate 0.3] [--adapters 4] [--budget 128]
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import random
import statistics
import tempfile
import time
from pathlib import Path

from bench.common import bench_parser, make_async_engine, peak_rss_mb, setup, write_json
from bench.lora_throughput import make_adapters

CONFIGS = {
    "chunked+prefix": dict(enable_chunked_prefill=True, enable_prefix_caching=True),
    "chunked": dict(enable_chunked_prefill=True, enable_prefix_caching=False),
    "prefix": dict(enable_chunked_prefill=False, enable_prefix_caching=True),
    "neither": dict(enable_chunked_prefill=False, enable_prefix_caching=False),
}


def workload(args, vocab: int) -> list[dict]:
    """Each adapter (and the base model) has its own ``--systems`` system prompts: KV computed
    under one adapter is never reused under another, so only (adapter, system) repeats hit."""
    rng = random.Random(args.seed)
    systems = [[rng.randrange(100, vocab) for _ in range(args.system_len)]
               for _ in range(args.systems * (args.adapters + 1))]
    t, reqs = 0.0, []
    for i in range(args.requests):
        t += rng.expovariate(args.rate)
        length = rng.randint(args.min_prompt, args.max_prompt)
        adapter = i % (args.adapters + 1)  # 0 = the base model
        system = None
        if length > args.system_len + 16:
            system = adapter * args.systems + rng.randrange(args.systems)
        head = systems[system] if system is not None else []
        prompt = head + [rng.randrange(100, vocab) for _ in range(length - len(head))]
        reqs.append(dict(arrival=t, prompt=prompt, system=system, adapter=adapter,
                         max_tokens=rng.randint(args.min_out, args.max_out)))
    return reqs


def pct(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(round(p / 100 * (len(s) - 1))))]


async def run_config(engine, reqs, adapters) -> dict:
    from loramux.engine import LoRARequest, SamplingParams

    start = time.perf_counter()
    records: list[dict] = []

    async def one(i: int, r: dict) -> None:
        await asyncio.sleep(max(0.0, start + r["arrival"] - time.perf_counter()))
        sent = time.perf_counter()
        lora = LoRARequest(f"a{r['adapter']}", r["adapter"], str(adapters[r["adapter"] - 1])) if r["adapter"] else None
        params = SamplingParams(temperature=0, max_tokens=r["max_tokens"], ignore_eos=True)
        stamps, seen = [], 0
        async for out in engine.generate({"prompt_token_ids": r["prompt"]}, params, f"r{i}", lora):
            n = len(out.outputs[0].token_ids)
            if n > seen:
                stamps += [time.perf_counter()] * (n - seen)
                seen = n
        records.append(dict(r, ttft=stamps[0] - sent, itl=[b - a for a, b in zip(stamps, stamps[1:], strict=False)],
                            tokens=seen, done=stamps[-1]))

    await asyncio.gather(*(one(i, r) for i, r in enumerate(reqs)))
    wall = max(r["done"] for r in records) - start
    ttft = [r["ttft"] for r in records]
    itl = [x for r in records for x in r["itl"]]
    tpot = [sum(r["itl"]) / len(r["itl"]) for r in records if r["itl"]]
    seen_systems: set[int] = set()
    cached, uncached = [], []
    for r in sorted(records, key=lambda r: r["arrival"]):
        if r["system"] is None:
            continue
        (cached if r["system"] in seen_systems else uncached).append(r["ttft"])
        seen_systems.add(r["system"])
    return {
        "output_tok_s": sum(r["tokens"] for r in records) / wall,
        "ttft_s": {f"p{p}": pct(ttft, p) for p in (50, 90, 99)},
        "itl_s": {f"p{p}": pct(itl, p) for p in (50, 90, 99)},
        "itl_p99_over_p50": pct(itl, 99) / pct(itl, 50),
        "tpot_ms_p50": pct(tpot, 50) * 1e3,
        # the step budget's goal: ITL p99 <= 3x the median request's time per output token
        "itl_p99_over_tpot_p50": pct(itl, 99) / pct(tpot, 50),
        "ttft_system_prompt_seen_before_p50": statistics.median(cached) if cached else None,
        "ttft_system_prompt_first_time_p50": statistics.median(uncached) if uncached else None,
        "wall_s": wall,
    }


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    for ax, key, title in ((axes[0], "ttft_s", "TTFT (s)"), (axes[1], "itl_s", "inter-token latency (s)")):
        for j, p in enumerate(("p50", "p90", "p99")):
            ax.bar([i + j * 0.27 for i in range(len(names))], [results[n][key][p] for n in names], 0.27, label=p)
        ax.set_xticks([i + 0.27 for i in range(len(names))], names, rotation=15)
        ax.set_title(title)
        ax.legend()
    axes[2].bar(names, [results[n]["output_tok_s"] for n in names])
    axes[2].set_title("output tokens/s")
    axes[2].tick_params(axis="x", rotation=15)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main() -> None:
    ap = bench_parser(__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=12)
    ap.add_argument("--rate", type=float, default=0.3, help="Poisson arrivals per second")
    ap.add_argument("--adapters", type=int, default=4)
    ap.add_argument("--systems", type=int, default=1, help="system prompts per adapter")
    ap.add_argument("--system-len", type=int, default=512)
    ap.add_argument("--min-prompt", type=int, default=50)
    ap.add_argument("--max-prompt", type=int, default=1500)
    ap.add_argument("--min-out", type=int, default=64)
    ap.add_argument("--max-out", type=int, default=256)
    ap.add_argument("--budget", type=int, default=128, help="max_num_batched_tokens with chunking on")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--configs", default=",".join(CONFIGS))
    args = ap.parse_args()
    model, _ = setup(args)
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        adapters = make_adapters(model, Path(tmp), args.adapters)
        reqs = None
        for name in args.configs.split(","):
            cfg = CONFIGS[name]
            budget = args.budget if cfg["enable_chunked_prefill"] else max(2048, args.max_prompt)
            engine = make_async_engine(
                model=str(model), dtype=args.dtype, device="cpu", max_model_len=2048,
                enable_prefix_caching=cfg["enable_prefix_caching"], kv_cache_memory=1 << 30,
                max_num_seqs=64, max_num_batched_tokens=budget,
                enable_chunked_prefill=cfg["enable_chunked_prefill"],
                enable_lora=True, max_loras=args.adapters, max_lora_rank=16)
            reqs = reqs or workload(args, engine.engine.model.dims.vocab_size)
            for i, a in enumerate(adapters):  # resident adapters: cold loads are another benchmark
                asyncio.run(_drain(engine, [100 + i] * 8, a, i + 1))
            for n in (50, 700, args.max_prompt):  # first-use costs of the kernels' shapes
                asyncio.run(_drain(engine, [(7 * j) % 9000 + 200 + n for j in range(n)], None, 0))
            results[name] = asyncio.run(run_config(engine, reqs, adapters))
            results[name]["prefix_cache"] = dataclasses.asdict(engine.stats())
            engine.shutdown()
            del engine
            gc.collect()
            r = results[name]
            print(f"{name:15s} {r['output_tok_s']:7.1f} tok/s  TTFT p50/p99 {r['ttft_s']['p50']:.2f}/"
                  f"{r['ttft_s']['p99']:.2f}s  ITL p50/p99 {r['itl_s']['p50'] * 1e3:.0f}/"
                  f"{r['itl_s']['p99'] * 1e3:.0f} ms", flush=True)
    ratios = {}
    if "chunked+prefix" in results and "prefix" in results:
        on, off = results["chunked+prefix"], results["prefix"]
        ratios["chunked_on_over_off"] = {
            "tok_s": on["output_tok_s"] / off["output_tok_s"],
            "itl_p99": on["itl_s"]["p99"] / off["itl_s"]["p99"],
            "ttft_p50": on["ttft_s"]["p50"] / off["ttft_s"]["p50"],
        }
    if "chunked+prefix" in results and "chunked" in results:
        on, off = results["chunked+prefix"], results["chunked"]
        ratios["prefix_on_over_off"] = {
            "tok_s": on["output_tok_s"] / off["output_tok_s"],
            "ttft_p50": on["ttft_s"]["p50"] / off["ttft_s"]["p50"],
        }
        seen, first = on["ttft_system_prompt_seen_before_p50"], off["ttft_system_prompt_seen_before_p50"]
        if seen and first:
            ratios["prefix_on_over_off"]["ttft_cached_system_prompt_p50"] = seen / first
    print("ratios", ratios)
    payload = {"args": vars(args), "results": results, "ratios": ratios, "peak_rss_mb": peak_rss_mb()}
    out = write_json("serving_mixed", payload)
    plot(results, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")


async def _drain(engine, prompt, adapter_path, idx) -> None:
    from loramux.engine import LoRARequest, SamplingParams

    lora = LoRARequest(f"a{idx}", idx, str(adapter_path)) if adapter_path is not None else None
    async for _ in engine.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=1), None, lora):
        pass


if __name__ == "__main__":
    main()
