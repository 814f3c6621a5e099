"""The compiled CPU kernels in tests: required wherever a compiler could have built them.

The package build compiles them (``setup.py``); a test that needs them skips only where this
machine has no C/C++ compiler (so the install had to leave them out). Where a compiler
exists they must load: a broken build fails the test instead of hiding behind a skip.
"""

from __future__ import annotations

import shutil
from contextlib import contextmanager

import pytest


def compiler_present() -> bool:
    """A C and a C++ compiler on PATH (what ``setup.py`` needs to build the kernels)."""
    return bool((shutil.which("cc") or shutil.which("gcc")) and (shutil.which("c++") or shutil.which("g++")))


def require_cpu_kernel() -> None:
    """Skip without a compiler; else assert the kernels loaded (``loader.status()`` ok)."""
    from loramux.engine.model.kernels import loader

    st = loader.status()
    if st.available:
        return
    if not compiler_present():
        pytest.skip(f"no C/C++ compiler here, so no compiled CPU kernels: {st.reason}")
    raise AssertionError(f"a compiler is present but the CPU kernels are {st.state}: {st.reason}")


ISAS = ("scalar", "avx2", "avx512", "avx512bf16")
"""Every ISA variant the build may carry (parametrize with it; :func:`forced_isa` skips the
ones this CPU cannot run)."""


def wq_bf16_bands(isa: str, rows: int) -> bool:
    """Whether ``loramux::wq_linear`` in the ``isa`` variant multiplies ``rows`` of bf16 x (with a
    bf16 y) by bf16 bands of W (each weight rounded to bf16 once, oneDNN's bf16 GEMM): the
    variant with native bf16 GEMMs from ``DENSE_MIN_M_BF16`` (24) rows (csrc/quant_ops.cpp).
    Every other call keeps fp32 sums of the exact weights, rounded once (the kernel's, or fp32
    bands' from ``DENSE_MIN_M_AVX2`` rows in the avx2 and scalar variants)."""
    return isa == "avx512bf16" and rows >= 24


WQ_FP32_BAND_ROWS = 256
"""From this many rows the avx2 variant hands fp32 bands of W to MKL (``DENSE_MIN_M_AVX2``)."""


@contextmanager
def forced_isa(name: str):
    """Run the kernels' ``name`` variant inside the block (``auto`` again after it)."""
    from loramux.engine.model.kernels import loader

    require_cpu_kernel()
    if name not in loader.isas():
        pytest.skip(f"this CPU does not run the {name} kernels (it runs {loader.isas()})")
    loader.select_isa(name)
    try:
        yield
    finally:
        loader.select_isa("auto")
