"""The sweep the model benchmarks share (``bench.model_families``, ``bench.dora``,
``bench.moe``): one model, several kinds of run (the base model, sets of adapters), each
kind on ``bench.fast_step``'s workload in each of two shapes after a warm-up."""

from __future__ import annotations

import argparse
from pathlib import Path

SHAPES = {
    "uniform": dict(num_prompts=16, rate=1e9, prefix_len=0, min_len=32, max_len=32, new_tokens=32),
    "serving": dict(num_prompts=12, rate=1.5, prefix_len=96, min_len=100, max_len=200, new_tokens=24),
}
"""``uniform``: all requests at once, 32-token prompts, 32 new tokens; ``serving``: Poisson
arrivals, a shared prefix, longer prompts."""


def shape_workload(shape: str, dtype: str, quick: bool = False) -> argparse.Namespace:
    """``bench.fast_step``'s workload arguments of one of :data:`SHAPES`; ``quick`` halves
    the requests (at least 4) and makes 16 new tokens."""
    wl = argparse.Namespace(**SHAPES[shape], dtype=dtype)
    if quick:
        wl.num_prompts, wl.new_tokens = max(4, wl.num_prompts // 2), 16
    return wl


def sweep(model: Path, tok, kinds: dict[str, list | None], shapes: list[str], results: dict, *,
          dtype: str, quick: bool = False, label: str = "", warm: list[str] | None = None,
          pairs: int | None = None) -> dict[str, list[dict[str, dict]]]:
    """Run every kind (``name -> LoRARequest`` list, None for the base model) on every shape.

    First one warm-up run (4 requests of 4 tokens: oneDNN primitives, kernels, adapter loads)
    for each kind in ``warm`` (default: every kind with adapters). Each run's numbers (from
    ``bench.fast_step.run``) go into ``results`` under ``<label><shape>/<kind>`` and are
    printed. With ``pairs`` the kinds run that many rounds, each in the other order than the
    last, the round appended to the key (``/<round>``). Returns, per shape, the rounds as
    ``{kind: numbers}``."""
    from bench.fast_step import make_workload, run

    warm_wl = shape_workload("uniform", dtype)
    warm_wl.num_prompts, warm_wl.new_tokens = 4, 4
    for kind in warm if warm is not None else [k for k, loras in kinds.items() if loras]:
        run(model, *make_workload(tok, warm_wl), kinds[kind], warm_wl, False)
    rounds: dict[str, list[dict[str, dict]]] = {}
    order = list(kinds.items())
    for shape in shapes:
        wl = shape_workload(shape, dtype, quick)
        prompts, arrivals = make_workload(tok, wl)
        rounds[shape] = []
        for rep in range(pairs or 1):
            done: dict[str, dict] = {}
            for kind, loras in order if rep % 2 == 0 else order[::-1]:
                key = f"{label}{shape}/{kind}" + (f"/{rep}" if pairs else "")
                results[key] = r = done[kind] = run(model, prompts, arrivals, loras, wl, False)
                print(f"{key:26s} {r['tok_s']:7.1f} tok/s  TTFT p50 {r['ttft_p50_ms']:7.1f} ms  "
                      f"TPOT p50 {r['tpot_p50_ms']:6.1f} ms  {r['tok_per_cpu_s']:6.1f} tok/cpu-s", flush=True)
            rounds[shape].append(done)
    return rounds
