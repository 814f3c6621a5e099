"""One thread of a server runs OpenMP teams: the engine's stepping thread.

torch's intra-op parallelism, oneDNN's GEMMs and loramux's C kernels share the one OpenMP
runtime torch loads (GNU libgomp). libgomp keeps a pool of worker threads for every thread that
started a parallel region, and once its pooled threads outnumber the CPUs it stops letting a
waiting worker spin (its throttled spin count): every parallel region then wakes its team
through the kernel, tens of microseconds each, hundreds of regions a decode step. In the server
the model was loaded on one thread (a worker of the HTTP front end's pool) and the steps ran on
another, so both kept a pool: a decode step of the default model in bf16 took 53-61 ms on a
second thread against 26-27 ms once only that thread had a pool (2-core AVX-512-BF16 EPYC), and
one stream's inter-token time in the live server was 32-40 ms against the engine's 21 ms step.

So the engine's thread keeps a team of the CPUs, and other threads that run torch work in a
server free their pool (:func:`release_pool`: the thread that built the engine) or run that work
on themselves alone, with no team and no pool (:func:`confine_thread` for a thread's whole life:
the event loop's, a tensor-parallel rank's DoRA thread; :func:`single_threaded` / :func:`alone` for
a block of work on a shared worker thread: the registry's opening, the first start's bootstrap,
uploads and exports). The adapter loader's threads keep their teams while they load (confined, a
neighbour's latency beside an adapter spray suffered: docs/architecture.md) and free them after
(its slot thread after each write; a disk thread's pool goes with the thread). Where no
OpenMP runtime is found (another platform or build) each is a no-op that says so by returning
False.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import re
from collections.abc import Iterator

import torch

logger = logging.getLogger(__name__)

__all__ = ["alone", "available", "confine_thread", "release_pool", "single_threaded"]

_OMP_PAUSE_SOFT = 1
_RUNTIME = re.compile(r"\S*/lib(?:gomp|iomp5|omp)[^/\s]*\.so[.\d]*$")


@functools.cache
def _runtime() -> ctypes.CDLL | None:
    """The OpenMP runtime this process loaded (torch's), or None."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {m.group(0) for line in maps if (m := _RUNTIME.search(line.strip()))}
    except OSError:
        return None
    for path in sorted(paths):
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        if all(hasattr(lib, f) for f in ("omp_set_num_threads", "omp_pause_resource_all")):
            lib.omp_set_num_threads.argtypes = [ctypes.c_int]
            lib.omp_pause_resource_all.argtypes = [ctypes.c_int]
            return lib
    logger.debug("no OpenMP runtime found: threads' teams left as they are")
    return None


def available() -> bool:
    """True when the OpenMP runtime torch uses was found (the functions below act)."""
    return _runtime() is not None


def release_pool() -> bool:
    """Free the calling thread's pool of OpenMP workers (they exit; a later parallel region on
    this thread starts a new one). False: no runtime, or the runtime refused (inside a region)."""
    lib = _runtime()
    return lib is not None and lib.omp_pause_resource_all(_OMP_PAUSE_SOFT) == 0


def _set_threads(n: int) -> None:
    # torch sets a thread's team size at its first parallel op: done first, so ours stays
    torch.get_num_threads()
    _runtime().omp_set_num_threads(n)


def confine_thread() -> bool:
    """From now on torch work on the calling thread runs on it alone (no team, no pool): the
    initializer of a helper thread. False where there is no runtime."""
    if _runtime() is None:
        return False
    _set_threads(1)
    release_pool()
    return True


def alone(fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` under :func:`single_threaded`: what a shared worker thread (the
    HTTP front end's thread pool) runs when its work may call torch."""
    with single_threaded():
        return fn(*args, **kwargs)


@contextlib.contextmanager
def single_threaded() -> Iterator[None]:
    """Torch work inside the block runs on the calling thread alone; the thread's team size is
    restored after it (a shared worker thread: an upload's checks, an export's merge)."""
    if _runtime() is None:
        yield
        return
    before = torch.get_num_threads()
    _set_threads(1)
    release_pool()
    try:
        yield
    finally:
        _set_threads(before)
