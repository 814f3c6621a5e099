"""Tests of the CPU attention kernel: skipped only where no C compiler exists."""

from __future__ import annotations

import pytest

from loramux.engine.model.cpu_attention import kernel_available
from loramux.engine.model.cpu_kernels import find_compiler


def require_cpu_kernel() -> None:
    """Skip when this machine has no C compiler; where it has one, the kernel must build
    and load (a broken kernel fails the test instead of hiding behind a skip)."""
    if find_compiler() is None:
        pytest.skip("no C compiler here: the engine uses the torch attention path")
    assert kernel_available(), "a C compiler is present but the CPU attention kernel did not build or load"
