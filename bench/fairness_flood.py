"""The flood case of ``python -m bench.fairness --flood``: one key keeps ``streams × n``
sequences running (8 × 32 = 256 by default), another key sends an 8-token greedy request
now and then; step budget on ÷ off on the same engine (swapped between runs).

Reports the quiet request's latency idle and beside the flood (p50, p99 = worst of
``--quiet-requests``), quiet p99 ÷ idle per configuration, and the flood's output tokens/s
while the quiet requests ran, budget on ÷ off. Goal: quiet p99 ≤ 3× idle with the budget.
"""

from __future__ import annotations

import asyncio
import statistics
import time

from bench.common import make_engine


async def _quiet(engine, params, tag: str) -> float:
    t0 = time.monotonic()
    async for _ in engine.generate({"prompt_token_ids": [100 + i for i in range(8)]}, params,
                                   f"quiet-{tag}-{t0}", fairness_key="quiet"):
        pass
    return time.monotonic() - t0


async def _flood_run(engine, core, args, flood_params, quiet_params, label: str) -> dict:
    tokens = [0]

    async def one(i: int) -> None:
        seen = 0
        async for out in engine.generate({"prompt_token_ids": [200 + i, 300 + i]}, flood_params,
                                         f"flood-{label}-{i}", fairness_key="flood"):
            n = sum(len(o.token_ids) for o in out.outputs)
            tokens[0] += n - seen
            seen = n

    tasks = [asyncio.ensure_future(one(i)) for i in range(args.flood_streams)]
    want = args.flood_streams * args.flood_n
    deadline = time.monotonic() + 300
    while len(core.scheduler.running) < want and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    t0, before = time.monotonic(), tokens[0]
    beside = [await _quiet(engine, quiet_params, f"{label}{i}") for i in range(args.quiet_requests)]
    elapsed, made = time.monotonic() - t0, tokens[0] - before
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return {"quiet_p50": statistics.median(beside), "quiet_p99": max(beside), "quiet": beside,
            "flood_tokens_per_s": made / elapsed}


def flood_case(args) -> dict:
    """Run the flood case; returns the results (the caller writes them)."""
    from loramux.engine.async_engine import AsyncEngine
    from loramux.engine.sampling_params import SamplingParams
    from loramux.engine.step_budget import StepBudget

    want = args.flood_streams * args.flood_n
    core = make_engine(model=args.model, max_model_len=args.flood_tokens + 64, max_num_seqs=want + 8)
    engine = AsyncEngine(core)
    quiet_params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    flood_params = SamplingParams(n=args.flood_n, temperature=1.0, max_tokens=args.flood_tokens,
                                  ignore_eos=True)
    results: dict = {}

    warm_budget = core.scheduler.budget or StepBudget(core.config.scheduler.target_itl_ms)

    def set_budget(on: bool) -> None:  # on: the engine's own budget, warm from the idle runs
        core.scheduler.budget = warm_budget if on else None

    async def go() -> None:
        await _quiet(engine, quiet_params, "warm")
        results["idle"] = min([await _quiet(engine, quiet_params, f"idle{i}") for i in range(3)])
        for label, on in (("budget_on", True), ("budget_off", False)):
            await engine.call(lambda on=on: set_budget(on))
            results[label] = await _flood_run(engine, core, args, flood_params, quiet_params, label)
            print(label, results[label], flush=True)

    try:
        asyncio.run(go())
    finally:
        engine.shutdown()
    on, off, idle = results["budget_on"], results["budget_off"], results["idle"]
    results["ratios"] = {
        "quiet_p99_over_idle_budget_on": on["quiet_p99"] / idle,
        "quiet_p99_over_idle_budget_off": off["quiet_p99"] / idle,
        "flood_throughput_on_over_off": on["flood_tokens_per_s"] / max(off["flood_tokens_per_s"], 1e-9),
    }
    print("idle quiet latency", idle, "ratios", results["ratios"])
    return results
