"""Shared helpers of the benchmarks: the flags they share and their set-up, workload,
timing, peak RSS, JSON output. Every benchmark runs from the repository root as a module,
``python -m bench.<name>``."""

from __future__ import annotations

import argparse
import json
import platform
import resource
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"


def bench_parser(doc: str | None, *, dtype: str | None = "bfloat16", threads: int = 2,
                 threads_help: str | None = None, quick: str | None = None,
                 out: str | None = None) -> argparse.ArgumentParser:
    """A benchmark's parser (``doc`` as its help) with the flags they share: ``--dtype``
    (unless ``dtype`` is None), ``--threads`` (torch threads; :func:`setup` sets them),
    ``--quick`` where ``quick`` says what it shortens, ``--out`` (the results' name in
    bench/results/) where ``out`` is its default."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    if dtype is not None:
        ap.add_argument("--dtype", default=dtype)
    ap.add_argument("--threads", type=int, default=threads, help=threads_help)
    if quick is not None:
        ap.add_argument("--quick", action="store_true", help=quick)
    if out is not None:
        ap.add_argument("--out", default=out, help=f"results name (bench/results/<out>.*, default {out})")
    return ap


def add_random_model_flags(ap: argparse.ArgumentParser, *, layers: int = 8) -> None:
    """``--hidden`` and ``--layers`` of the random models a benchmark builds."""
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=layers)


def setup(args) -> tuple[Path, object]:
    """Called first in a benchmark's ``main`` once its flags are parsed: sets torch's thread
    count (``--threads``); returns the default model's folder and its tokenizer."""
    from transformers import AutoTokenizer

    from loramux.engine.default_model import default_model_path

    torch.set_num_threads(args.threads)
    path = default_model_path()
    return path, AutoTokenizer.from_pretrained(path)


def make_engine(**options):
    """An ``LLMEngine`` of flat vLLM-style engine options (``EngineConfig.from_options``:
    ``model=..., max_num_seqs=8, enable_lora=True, max_loras=2``)."""
    from loramux.engine.config import EngineConfig
    from loramux.engine.engine import LLMEngine

    return LLMEngine(EngineConfig.from_options(**options))


def make_async_engine(**options):
    """:func:`make_engine` behind an ``AsyncEngine`` (its own engine thread)."""
    from loramux.engine.async_engine import AsyncEngine

    return AsyncEngine(make_engine(**options))


def module_command(module: str, *args: str) -> list[str]:
    """The command that runs ``bench.<module>`` with ``args`` in a new interpreter (this
    one); run it with ``cwd=ROOT``."""
    return [sys.executable, "-m", f"bench.{module}", *args]


def workload_parser(doc: str | None) -> argparse.ArgumentParser:
    """The shared workload flags: 32 prompts of 32 tokens, 64 new tokens, 2 threads."""
    ap = bench_parser(doc, dtype=None)
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    return ap


def default_workload(args) -> tuple[Path, object, list[list[int]]]:
    """:func:`setup`, then the prompts too: (default model folder, its tokenizer, the prompts)."""
    path, tok = setup(args)
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


def cpu_name() -> str:
    """The CPU's model name (Linux), else the machine type: every result names its CPU."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine()


def has_avx512_bf16() -> bool:
    """Whether the CPU has native bf16 (the dtype to serve in there)."""
    try:
        return "avx512_bf16" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
