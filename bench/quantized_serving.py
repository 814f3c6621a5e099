"""The serving run of ``bench.quantized``: one base (float or quantized checkpoint) served
through the AsyncEngine with Poisson arrivals and mixed prompt lengths, once with the requests
spread over 4 adapters and the base (one in five on the base) and once with the same requests
(same prompts, arrivals and lengths) all on the base: output tokens/s, TTFT and TPOT of each
and LoRA ÷ base tokens/s, the cost of the adapters on that base (the issue's goal: ≥ 0.9 on a
quantized base). The workload and its per-request records are ``bench.serving_mixed``'s.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
from pathlib import Path

from bench.common import make_async_engine
from bench.serving_mixed import _drain, run_config, workload

ADAPTERS = 4


def serving_args(requests: int, rate: float, seed: int = 0) -> argparse.Namespace:
    """The workload's knobs (``serving_mixed.workload``): prompts of 50-600 tokens (those past a
    256-token system prompt share their adapter's), 32-96 output tokens, ``rate`` req/s."""
    return argparse.Namespace(requests=requests, rate=rate, adapters=ADAPTERS, systems=1, system_len=256,
                              min_prompt=50, max_prompt=600, min_out=32, max_out=96, seed=seed)


def serve(folder: Path, dtype: str, adapters: list[Path], args: argparse.Namespace) -> dict:
    """{"lora": ..., "base": ..., "lora_over_base_tok_s": ...} for the base in ``folder``; each
    pass on an engine of its own, so neither finds the other's prompts in its prefix cache."""
    out = {}
    for name in ("lora", "base"):
        engine = make_async_engine(model=str(folder), dtype=dtype, device="cpu", max_model_len=1024,
                                   enable_prefix_caching=True, kv_cache_memory=1 << 29, max_num_seqs=32,
                                   enable_lora=True, max_loras=ADAPTERS, max_lora_rank=16)
        try:
            reqs = workload(args, engine.engine.model.dims.vocab_size)
            if name == "base":
                reqs = [dict(r, adapter=0) for r in reqs]
            for i, a in enumerate(adapters):  # resident adapters: cold loads are another benchmark
                asyncio.run(_drain(engine, [100 + i] * 8, a, i + 1))
            for n in (50, 300, args.max_prompt):  # first-use costs of the kernels' shapes
                asyncio.run(_drain(engine, [(7 * j) % 9000 + 200 + n for j in range(n)], None, 0))
            r = asyncio.run(run_config(engine, reqs, adapters))
            out[name] = {"output_tok_s": r["output_tok_s"], "ttft_s": r["ttft_s"],
                         "tpot_ms_p50": r["tpot_ms_p50"], "wall_s": r["wall_s"]}
        finally:
            engine.shutdown()
            del engine
            gc.collect()
    out["lora_over_base_tok_s"] = out["lora"]["output_tok_s"] / out["base"]["output_tok_s"]
    return out


__all__ = ["ADAPTERS", "serve", "serving_args"]
