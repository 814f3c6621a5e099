"""Tests of the CPU kernels (attention, fused small ops): skipped only where no C compiler exists."""

from __future__ import annotations

import pytest

from loramux.engine.model.cpu_attention import kernel_available
from loramux.engine.model.cpu_kernels import FUSED_OPS_SIGNATURES, find_compiler, fused_op


def require_cpu_kernel() -> None:
    """Skip when this machine has no C compiler; where it has one, the kernels must build
    and load (a broken kernel fails the test instead of hiding behind a skip)."""
    if find_compiler() is None:
        pytest.skip("no C compiler here: the engine uses the torch paths")
    assert kernel_available(), "a C compiler is present but the CPU attention kernel did not build or load"
    missing = [s for s in FUSED_OPS_SIGNATURES if fused_op(s) is None]
    assert not missing, f"a C compiler is present but the fused ops {missing} did not build or load"
