"""The CPU kernels in ``csrc/``: compiled with the machine's C compiler, loaded with ctypes.

``make install`` builds them (``python -m loramux.engine.model.cpu_kernels``); otherwise the
first engine start-up does (about a second). The shared library lands in
``$LORAMUX_KERNEL_CACHE`` (default ``~/.cache/loramux/kernels``) under a name that hashes
the source, the flags, the compiler and the CPU's feature flags, so a changed kernel or a
different machine builds anew (the shared header ``csrc/bf16.h`` counts as source). When there is no compiler, the build fails or the library
does not load, :func:`kernel_function` returns None and logs why once: callers fall
back to the torch path.

The kernels: ``paged_attention`` (decode rows and prompt chunks over a cached prefix),
``fused_ops`` (residual add + RMSNorm, rope, SiLU-and-mul) and ``lora_sgmv`` (multi-LoRA
shrink + expand over runs of same-adapter tokens).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import torch

from loramux.engine.errors import KernelBuildError

logger = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=c11")
# glibc's vector math (expf on AVX2 lanes) where the x86-64 kernels call it
LIBS = ("-lm", "-lmvec") if sys.platform == "linux" and platform.machine() == "x86_64" else ("-lm",)

_lock = threading.Lock()
_cache: dict[str, object] = {}
_MISSING = object()


def cache_dir() -> Path:
    """Where compiled kernels are kept."""
    root = os.environ.get("LORAMUX_KERNEL_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "loramux" / "kernels"


def find_compiler() -> str | None:
    """The C compiler kernels are built with (``$CC``, else ``cc`` or ``gcc`` on PATH), or None."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def _compiler() -> str:
    cc = find_compiler()
    if not cc:
        raise KernelBuildError("no C compiler found (install gcc, or set CC)")
    return cc


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return sys.platform


def library_path(name: str) -> Path:
    """The cached library for kernel ``name`` (``csrc/<name>.c``) on this machine."""
    cc = _compiler()
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise KernelBuildError(f"C compiler {cc!r} does not run: {e}") from None
    h = hashlib.sha256()
    headers = [h.read_bytes() for h in sorted(CSRC.glob("*.h"))]
    for part in ((CSRC / f"{name}.c").read_bytes(), *headers, " ".join(CFLAGS + LIBS).encode(),
                 version.encode(), _cpu_flags().encode()):
        h.update(part)
    return cache_dir() / f"{name}-{h.hexdigest()[:16]}.so"


def build(name: str) -> Path:
    """Compile ``csrc/<name>.c`` unless this machine's build is cached; returns the library."""
    src = CSRC / f"{name}.c"
    if not src.is_file():
        raise KernelBuildError(f"kernel source {src} is missing from the installation")
    path = library_path(name)
    if path.is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
    os.close(fd)
    try:
        proc = subprocess.run([_compiler(), *CFLAGS, "-o", tmp, str(src), *LIBS],
                              capture_output=True, text=True, timeout=300)
        if proc.returncode != 0:
            raise KernelBuildError(f"compiling {src.name} failed: {proc.stderr.strip()[-2000:]}")
        os.replace(tmp, path)  # atomic: concurrent builders never load a partial file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def load(name: str) -> ctypes.CDLL:
    """Build if needed and load kernel ``name``. Raises :class:`KernelBuildError`. (torch,
    imported by this module, is loaded first: its libgomp is the process's OpenMP runtime.)"""
    path = build(name)
    try:
        return ctypes.CDLL(str(path))
    except OSError as e:
        raise KernelBuildError(f"loading {path} failed: {e}") from None


def kernel_function(name: str, symbol: str, argtypes: list, purpose: str):
    """C function ``symbol`` of kernel ``name`` with its ctypes signature (returns int), or
    None when it cannot be built or loaded here; the reason is logged once, naming
    ``purpose`` (what falls back to torch). ``LORAMUX_CPU_KERNELS=0`` disables every kernel."""
    fn = _cache.get(symbol, _MISSING)
    disabled = os.environ.get("LORAMUX_CPU_KERNELS", "1") == "0"  # per call: benches toggle it
    if fn is not _MISSING and not disabled:
        return fn
    if disabled:
        if f"off:{symbol}" not in _cache:
            _cache[f"off:{symbol}"] = None
            logger.info("CPU kernels disabled (LORAMUX_CPU_KERNELS=0): torch %s", purpose)
        return None
    with _lock:
        if symbol in _cache:
            return _cache[symbol]
        try:
            fn = getattr(load(name), symbol)
            fn.argtypes = argtypes
            fn.restype = ctypes.c_int
        except (KernelBuildError, OSError, AttributeError) as e:
            logger.warning("CPU kernel %s unavailable, using torch %s: %s", name, purpose, e)
            fn = None
        _cache[symbol] = fn
        return fn


_vp, _i, _i64, _f = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float


DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}
"""The dtype codes every kernel takes (``csrc/bf16.h``): 0 = fp32, 1 = bf16."""


def paged_attention_kernel():
    """The ``loramux_paged_attention`` C function, or None (reason logged once)."""
    return kernel_function(
        "paged_attention", "loramux_paged_attention",
        [_vp, _i64, _vp, _vp, _vp, _vp, _i64, _vp, _vp, _vp, _i, _i, _i, _i, _i, _i, _f, _i, _i],
        "attention",
    )


FUSED_OPS_SIGNATURES = {
    "loramux_add_rms_norm": [_vp, _i64, _vp, _i64, _i, _vp, _vp, _i, _i64, _i64, _f, _i, _i],
    "loramux_rope": [_vp, _i64, _vp, _vp, _vp, _i64, _i, _i, _i, _i],
    "loramux_silu_mul": [_vp, _i64, _vp, _i, _i64, _i64, _i, _i],
    "loramux_lora_sgmv": [_vp, _i64, _i, _vp, _vp, _i, _vp, _i64, _i, _vp, _i, _vp, _i, _i, _i, _i, _vp, _i],
}
_KERNEL_OF = {"loramux_lora_sgmv": "lora_sgmv"}


def fused_op(symbol: str):
    """One of the fused CPU ops (``FUSED_OPS_SIGNATURES``: the small ops of
    ``csrc/fused_ops.c``, the LoRA SGMV of ``csrc/lora_sgmv.c``), or None (reason logged once)."""
    name = _KERNEL_OF.get(symbol, "fused_ops")
    return kernel_function(name, symbol, FUSED_OPS_SIGNATURES[symbol], f"path for {symbol}")


def main() -> int:
    """``python -m loramux.engine.model.cpu_kernels``: build every kernel (``make install``).
    Exits 0 even when a kernel does not build (the engine falls back, logging why)."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for src in sorted(CSRC.glob("*.c")):
        try:
            print(f"{src.stem}: {build(src.stem)}")
        except KernelBuildError as e:
            print(f"{src.stem}: not built ({e}); the engine will use the torch path", file=sys.stderr)
    return 0  # a machine without a compiler still installs; the engine falls back


if __name__ == "__main__":
    raise SystemExit(main())
