"""Loading the compiled CPU kernels, and what the engine reports about them.

The kernels are ``torch.ops.loramux.*`` operators in the extension ``_C`` beside this file,
built by the package build (``setup.py``), not at run time. :func:`status` loads it once
(the first engine start, or the first call) and says whether the engine's hot path can use
it: ``ok``, ``disabled`` (``LORAMUX_CPU_KERNELS=0``) or ``degraded`` (not installed, or it
does not load here: the reason says why). Without it every part of the step runs on torch
ops, correct but several times slower on the CPU; the engine logs that once at start-up and
reports it in ``EngineStats`` (``/ready``, the dashboard, ``loramux_cpu_kernels_available``).

``python -m loramux.engine.model.kernels.loader`` prints the status (``make install`` runs it
with ``--require``: exit 1 unless the kernels load).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import threading
from dataclasses import dataclass

import torch

from loramux.engine import envs

logger = logging.getLogger(__name__)

EXTENSION = "loramux.engine.model.kernels._C"

_lock = threading.Lock()
_loaded = False
_error: str | None = None


@dataclass(frozen=True)
class KernelStatus:
    """Whether the engine runs the compiled CPU kernels (:func:`status`)."""

    state: str
    """``ok`` (loaded and on), ``disabled`` (``LORAMUX_CPU_KERNELS=0``) or ``degraded``."""
    reason: str | None = None
    """Why not ``ok`` (may name paths: shown to the admin only)."""
    isa: str | None = None
    """The ISA variant the kernels run (``avx512bf16``, ``avx512``, ``avx2``, ``scalar``) when
    loaded."""

    @property
    def available(self) -> bool:
        return self.state == "ok"


def _load() -> str | None:
    """Import the extension and register its fake implementations, once; returns None, or
    why the kernels cannot be used here (logged once)."""
    global _loaded, _error
    if _loaded:
        return _error
    with _lock:
        if _loaded:
            return _error
        try:
            importlib.import_module(EXTENSION)
            from loramux.engine.model.kernels import fake

            fake.register()
            if envs.LORAMUX_CPU_ISA != "auto":
                torch.ops.loramux.select_isa(envs.LORAMUX_CPU_ISA)
        except ModuleNotFoundError as e:
            _error = (f"the compiled CPU kernels are not installed ({e}); reinstall loramux "
                      "where a C and C++ compiler are present (make install)")
        except (ImportError, OSError) as e:
            _error = f"the compiled CPU kernels do not load: {e}"
        except ValueError as e:  # LORAMUX_CPU_ISA names a variant this CPU cannot run
            _error = f"LORAMUX_CPU_ISA={envs.LORAMUX_CPU_ISA}: {e}"
        if _error is None:
            logger.info("CPU kernels: torch.ops.loramux loaded (%s variant)", torch.ops.loramux.isa())
        else:
            logger.warning("CPU kernels unavailable, the engine runs on torch ops (several times "
                           "slower on the CPU; /ready reports kernels degraded): %s", _error)
        _loaded = True
        return _error


def require():
    """``torch.ops.loramux``, or RuntimeError saying why the kernels are not loaded."""
    if _load() is not None:
        raise RuntimeError(f"the CPU kernels are not loaded: {_error}")
    return torch.ops.loramux


def available() -> bool:
    """True when the compiled kernels are loaded and not turned off (cheap: the engine asks at
    every LoRA layer call)."""
    return envs.LORAMUX_CPU_KERNELS and _load() is None


def status() -> KernelStatus:
    """The kernels' state for the engine's reports (loads them on first call)."""
    if not envs.LORAMUX_CPU_KERNELS:
        return KernelStatus("disabled", "turned off with LORAMUX_CPU_KERNELS=0")
    error = _load()
    if error is not None:
        return KernelStatus("degraded", error)
    return KernelStatus("ok", None, torch.ops.loramux.isa())


def select_isa(name: str) -> str:
    """Run the ``name`` variant from now on (``auto``: the best this CPU runs); returns the
    variant running. Raises ``ValueError`` for one this CPU cannot run. Tests use it to check
    every variant; ``LORAMUX_CPU_ISA`` sets it at load."""
    return require().select_isa(name)


def isas() -> list[str]:
    """The variants this binary carries that this CPU runs, best first (empty when not loaded)."""
    return list(torch.ops.loramux.isas()) if _load() is None else []


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Print whether the compiled CPU kernels load here.")
    ap.add_argument("--require", action="store_true", help="exit 1 unless they load")
    args = ap.parse_args(argv)
    st = status()
    if st.available:
        print(f"CPU kernels: ok ({st.isa} variant; this CPU runs {', '.join(isas())})")
    else:
        print(f"CPU kernels: {st.state}: {st.reason}")
    return 1 if args.require and not st.available else 0


if __name__ == "__main__":
    raise SystemExit(main())
