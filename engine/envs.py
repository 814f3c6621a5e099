"""The environment variables the engine reads: the one place in ``loramux.engine`` that reads
``LORAMUX_*`` (as vLLM's ``envs.py``; the platform's are ``Settings`` fields).

Each is read from the environment when accessed (``envs.LORAMUX_CPU_KERNELS``), so a test or a
benchmark that changes one between two engines in one process is heard.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    LORAMUX_CPU_KERNELS: bool = True
    LORAMUX_CPU_ISA: str = "auto"
    LORAMUX_CACHE_DIR: str | None = None
    LORAMUX_SOURCE_TREE: str | None = None

environment_variables: dict[str, Callable[[], Any]] = {
    # "0" turns the compiled CPU kernels off: every part of the step runs on torch ops (the
    # benchmarks' baseline). Read when an engine picks its paths and at each LoRA layer call.
    "LORAMUX_CPU_KERNELS": lambda: os.environ.get("LORAMUX_CPU_KERNELS", "1") != "0",
    # The CPU kernels' ISA variant: "auto" (the best this CPU runs), or one of "avx512bf16", "avx512",
    # "avx2", "scalar" (one the CPU cannot run makes the kernels unavailable, saying why).
    # Read once, when the kernels load.
    "LORAMUX_CPU_ISA": lambda: os.environ.get("LORAMUX_CPU_ISA", "auto").strip().lower() or "auto",
    # Where converted models are cached (default ~/.cache/loramux).
    "LORAMUX_CACHE_DIR": lambda: os.environ.get("LORAMUX_CACHE_DIR") or None,
    # Set by bench/source_tree.py where loramux runs from its checkout, not installed (the GPU
    # machine): tensor-parallel workers then map the same tree before they import loramux.
    "LORAMUX_SOURCE_TREE": lambda: os.environ.get("LORAMUX_SOURCE_TREE") or None,
}


def __getattr__(name: str) -> Any:
    if name in environment_variables:
        return environment_variables[name]()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return list(environment_variables)
