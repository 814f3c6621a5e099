"""The one guarded import of Triton: ``triton`` and ``triton.language`` (``tl``) where it is
installed, else None with ``HAS_TRITON`` False. The Triton kernels' modules import from here,
define their kernels only when ``HAS_TRITON``, and re-export it."""

from __future__ import annotations

try:  # pragma: no cover - depends on the environment
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover
    triton = None
    tl = None
    HAS_TRITON = False

__all__ = ["HAS_TRITON", "tl", "triton"]
