"""Shared helpers of the benchmarks: workload, timing, peak RSS, JSON output."""

from __future__ import annotations

import json
import platform
import resource
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"


def make_prompts(tokenizer, num: int, length: int, seed: int = 0) -> list[list[int]]:
    """``num`` prompts of exactly ``length`` token ids drawn from ordinary text tokens."""
    g = torch.Generator().manual_seed(seed)
    lo, hi = 1000, min(len(tokenizer), 40000)
    return torch.randint(lo, hi, (num, length), generator=g).tolist()


def peak_rss_mb() -> float:
    """Peak resident memory of this process so far, in MiB."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def write_json(name: str, payload: dict) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    payload = {
        "machine": {"python": platform.python_version(), "torch": torch.__version__,
                    "threads": torch.get_num_threads(), "processor": platform.processor()},
        **payload,
    }
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2))
    return path
