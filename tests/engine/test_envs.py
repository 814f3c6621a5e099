"""``engine/envs.py`` is the engine's one reader of ``LORAMUX_*`` variables, read when accessed."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from loramux.engine import envs

ENGINE = Path(envs.__file__).parent


def test_no_engine_module_but_envs_reads_loramux_variables():
    reads = re.compile(r"(environ|getenv)\b[^\n]*LORAMUX_")
    offenders = [str(py.relative_to(ENGINE)) for py in ENGINE.rglob("*.py")
                 if py.name != "envs.py" and reads.search(py.read_text())]
    assert not offenders, offenders


def test_variables_are_read_when_accessed(monkeypatch):
    monkeypatch.delenv("LORAMUX_CPU_KERNELS", raising=False)
    assert envs.LORAMUX_CPU_KERNELS is True
    monkeypatch.setenv("LORAMUX_CPU_KERNELS", "0")
    assert envs.LORAMUX_CPU_KERNELS is False
    monkeypatch.setenv("LORAMUX_CPU_ISA", " AVX2 ")
    assert envs.LORAMUX_CPU_ISA == "avx2"
    monkeypatch.setenv("LORAMUX_CACHE_DIR", "")
    assert envs.LORAMUX_CACHE_DIR is None
    assert set(dir(envs)) == set(envs.environment_variables)
    with pytest.raises(AttributeError, match="LORAMUX_NOPE"):
        envs.LORAMUX_NOPE  # noqa: B018
