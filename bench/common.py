"""Shared helpers of the benchmarks: workload, timing, peak RSS, JSON output."""

from __future__ import annotations

import argparse
import json
import platform
import resource
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"


def workload_parser(doc: str | None) -> argparse.ArgumentParser:
    """The shared workload flags: 32 prompts of 32 tokens, 64 new tokens, 2 threads."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    return ap


def default_workload(args) -> tuple[Path, object, list[list[int]]]:
    """Set the thread count; return (default model folder, its tokenizer, the prompts)."""
    from transformers import AutoTokenizer

    from loramux.engine.default_model import default_model_path

    torch.set_num_threads(args.threads)
    path = default_model_path()
    tok = AutoTokenizer.from_pretrained(path)
    return path, tok, make_prompts(tok, args.num_prompts, args.prompt_len)


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
