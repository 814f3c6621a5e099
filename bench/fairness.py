"""Fair scheduling across tenants: a flooding fairness key beside a quiet one, VTC ÷ FCFS.

Two keys send Poisson arrivals to one AsyncEngine (default model, base only): ``flood`` at
10× the ``quiet`` key's rate, enough to overload the engine. The same arrivals run once per
policy (``fairness_policy = vtc | fcfs``, swapped on the same engine between runs; prefix
caching on, with fresh random prompts of the same lengths per run so the runs do not warm
each other), each for ``--window`` seconds; whatever is
still running at the window's end is cancelled. First the quiet key runs alone (its idle
TTFT). Reports each key's share of the output tokens served in the window, the quiet key's
TTFT p50/p99 (a request with no token by the end counts with its wait so far) and total
output tokens/s, with ratios vtc ÷ fcfs. Writes bench/results/fairness.json and .png.

    python -m bench.fairness [--window 30] [--quiet-rate 0.6] [--ratio 10] [--max-num-seqs 16]

``--flood``: the flood-with-256-sequences case instead (``bench/fairness_flood.py``): one
key keeps ``--flood-streams`` × ``--flood-n`` sequences running, the quiet key's 8-token
request p99 ÷ its idle latency, step budget on ÷ off. Writes bench/results/fairness_flood.json.

    python -m bench.fairness --flood [--flood-streams 8] [--flood-n 32] [--flood-tokens 400]
"""

from __future__ import annotations

import asyncio
import random
import time

import torch

from bench.common import RESULTS, bench_parser, make_engine, write_json


def arrivals(rng: random.Random, rate: float, window: float) -> list[float]:
    t, out = 0.0, []
    while True:
        t += rng.expovariate(rate)
        if t >= window:
            return out
        out.append(t)


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


async def run(engine, schedule: list[tuple[float, str, list[int]]], params, window: float) -> dict:
    """Send ``schedule`` ((time, key, prompt) sorted) and cancel everything at ``window``."""
    tokens = {"flood": 0, "quiet": 0}
    ttft: dict[str, list[float]] = {"flood": [], "quiet": []}
    t0 = time.monotonic()

    async def one(at: float, key: str, prompt: list[int], i: int) -> None:
        await asyncio.sleep(max(0.0, t0 + at - time.monotonic()))
        sent, seen, first = time.monotonic(), 0, None
        try:
            async for out in engine.generate({"prompt_token_ids": prompt}, params, f"{key}-{i}-{t0}",
                                             fairness_key=key):
                n = len(out.outputs[0].token_ids)
                if n and first is None:
                    first = time.monotonic() - sent
                tokens[key] += n - seen
                seen = n
        finally:
            ttft[key].append(first if first is not None else time.monotonic() - sent)

    tasks = [asyncio.ensure_future(one(at, key, p, i)) for i, (at, key, p) in enumerate(schedule)]
    done, pending = await asyncio.wait(tasks, timeout=window)
    for t in pending:
        t.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    elapsed = time.monotonic() - t0
    total = sum(tokens.values())
    return {
        "share": {k: v / total if total else 0.0 for k, v in tokens.items()},
        "tokens": tokens,
        "tokens_per_s": total / elapsed,
        "quiet_ttft_p50": pct(ttft["quiet"], 0.5),
        "quiet_ttft_p99": pct(ttft["quiet"], 0.99),
        "quiet_requests": len(ttft["quiet"]),
        "unfinished": len(pending),
    }


def main() -> None:
    ap = bench_parser(__doc__, dtype=None)
    ap.add_argument("--window", type=float, default=30.0, help="seconds of arrivals per policy")
    ap.add_argument("--quiet-rate", type=float, default=0.6, help="quiet key requests/s")
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--ratio", type=float, default=10.0, help="flood rate ÷ quiet rate")
    ap.add_argument("--prompt-len", type=int, default=48)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--flood", action="store_true", help="the flood case (step budget on ÷ off)")
    ap.add_argument("--flood-streams", type=int, default=8)
    ap.add_argument("--flood-n", type=int, default=32)
    ap.add_argument("--flood-tokens", type=int, default=400)
    ap.add_argument("--quiet-requests", type=int, default=5)
    ap.add_argument("--model", default=None, help="model folder (default: the default model)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.flood:
        from bench.fairness_flood import flood_case

        write_json("fairness_flood", {"args": vars(args), **flood_case(args)})
        return

    from loramux.engine.async_engine import AsyncEngine
    from loramux.engine.fairness import make_policy
    from loramux.engine.sampling_params import SamplingParams

    core = make_engine(max_model_len=512, enable_prefix_caching=True,
                       max_num_seqs=args.max_num_seqs, max_num_batched_tokens=256)
    engine = AsyncEngine(core)
    rng = random.Random(args.seed)
    vocab = core.model.dims.vocab_size

    def prompt() -> list[int]:
        return [rng.randrange(100, vocab) for _ in range(args.prompt_len)]

    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    quiet_at = arrivals(rng, args.quiet_rate, args.window)
    flood_at = arrivals(rng, args.quiet_rate * args.ratio, args.window)

    def schedule() -> list[tuple[float, str, list[int]]]:
        """The same arrivals, new prompts (no prefix-cache hits across runs)."""
        return sorted([(t, "quiet", prompt()) for t in quiet_at] + [(t, "flood", prompt()) for t in flood_at],
                      key=lambda r: r[0])

    budget = core.scheduler.max_num_batched_tokens

    def set_policy(scheduler, policy) -> None:
        scheduler.policy = policy
    results: dict = {"args": vars(args)}

    async def go() -> None:
        await run(engine, [(0.0, "quiet", prompt())], params, 60)  # warm-up
        idle = [r for r in schedule() if r[1] == "quiet"]
        results["idle"] = await run(engine, idle[: max(3, len(idle) // 2)], params, args.window / 2)
        for policy in ("vtc", "fcfs"):
            # swapped on the engine thread, after the last run's aborts
            await engine.call(lambda p=policy: set_policy(core.scheduler, make_policy(p, budget)))
            results[policy] = await run(engine, schedule(), params, args.window)
            print(policy, results[policy], flush=True)

    try:
        asyncio.run(go())
    finally:
        engine.shutdown()
    idle = results["idle"]["quiet_ttft_p99"]
    vtc, fcfs = results["vtc"], results["fcfs"]
    results["ratios"] = {
        "quiet_p99_ttft_vtc_over_idle": vtc["quiet_ttft_p99"] / idle,
        "quiet_p99_ttft_fcfs_over_idle": fcfs["quiet_ttft_p99"] / idle,
        "quiet_p50_ttft_vtc_over_fcfs": vtc["quiet_ttft_p50"] / fcfs["quiet_ttft_p50"],
        "quiet_p99_ttft_vtc_over_fcfs": vtc["quiet_ttft_p99"] / fcfs["quiet_ttft_p99"],
        "throughput_vtc_over_fcfs": vtc["tokens_per_s"] / fcfs["tokens_per_s"],
    }
    print("idle quiet TTFT p50/p99", results["idle"]["quiet_ttft_p50"], idle)
    print("ratios", results["ratios"])
    write_json("fairness", results)
    plot(results)


def plot(results: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.5))
    pols = ["vtc", "fcfs"]
    a.bar(pols, [results[p]["share"]["quiet"] for p in pols], label="quiet")
    a.bar(pols, [results[p]["share"]["flood"] for p in pols],
          bottom=[results[p]["share"]["quiet"] for p in pols], label="flood")
    a.set_title("share of output tokens served")
    a.legend()
    names = ["idle", "vtc", "fcfs"]
    x = range(len(names))
    b.bar([i - 0.2 for i in x], [results[n]["quiet_ttft_p50"] for n in names], 0.4, label="p50")
    b.bar([i + 0.2 for i in x], [results[n]["quiet_ttft_p99"] for n in names], 0.4, label="p99")
    b.set_xticks(list(x), names)
    b.set_yscale("log")
    b.set_title("quiet key TTFT (s)")
    b.legend()
    fig.tight_layout()
    fig.savefig(RESULTS / "fairness.png", dpi=100)


if __name__ == "__main__":
    main()
