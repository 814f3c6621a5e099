"""Background adapter loads, off the engine loop, timed per tier.

Two kinds of worker, so a slow disk never queues a slot write behind it:

* ``disk``: up to ``LoRAConfig.lora_load_workers`` threads, store/disk → CPU tier
  (``load_adapter``, shape checks, a DoRA adapter's per-row scales against the base
  (``dora.py``), pinned memory on CUDA), optionally followed by the write into a device
  slot reserved for it. Loads that find every worker busy wait in a queue whose order the
  engine thread sets (:meth:`AdapterLoader.order`: admission's fair order, so one tenant's
  burst of cold adapters cannot hold a neighbour's one load behind all of its own); a
  worker takes the head as soon as it is free;
* ``slot``: one thread, CPU tier → a reserved device slot (the CPU device: a copy into the
  stacked slot buffers; on CUDA the engine thread enqueues the asynchronous copy itself).

A job returns a :class:`LoadResult`; the manager applies it on the engine thread
(``LoRAManager.poll``). A slot being written is reserved: no step reads it, nothing else
takes it, until the result is applied.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import torch

from loramux.adapters.format import LoraWeights, load_adapter
from loramux.adapters.vocab import local_base_tensor
from loramux.engine import omp_threads
from loramux.engine.errors import LoRAError
from loramux.engine.lora.dora import BaseProjections, dora_scales
from loramux.engine.lora.slots import SlotBuffers

TIERS = ("store", "disk", "cpu")
"""Where a load came from: ``store`` (the adapter source fetched the folder), ``disk``
(read into the CPU tier), ``cpu`` (CPU tier → device slot)."""


@dataclass
class LoadResult:
    """What one background job did."""

    weights: LoraWeights
    slot: int | None = None
    """The reserved slot now written (None: the weights only reached the CPU tier)."""
    seconds: dict[str, float] = field(default_factory=dict)
    """Seconds per tier this job spent (keys of :data:`TIERS`)."""


@dataclass
class LoadStats:
    """Loads per tier since start: counts and seconds (the metrics read these)."""

    loads: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(TIERS, 0.0))

    def add(self, seconds: dict[str, float]) -> None:
        for tier, s in seconds.items():
            self.loads[tier] += 1
            self.seconds[tier] += s

    def as_dict(self) -> dict[str, dict[str, float]]:
        return {t: {"loads": self.loads[t], "seconds": self.seconds[t]} for t in TIERS}


class AdapterLoader:
    """Runs disk loads on a small pool of threads and slot writes on their own thread."""

    def __init__(
        self, slots: SlotBuffers, cpu_dtype: torch.dtype, pin_memory: bool, family=None,
        base: BaseProjections | None = None, workers: int = 1,
    ) -> None:
        """``base``: the served projections a DoRA adapter's scales are computed against
        (None: DoRA adapters fail to load); ``workers``: disk loads running at once."""
        self.slots = slots
        self.base = base
        self.family = family  # the base's dims: what all-linear means
        self.cpu_dtype = cpu_dtype
        self.pin_memory = pin_memory
        self.workers = workers
        self._lock = threading.Lock()
        self._queue: list[tuple[str, Future, Callable[[], LoadResult]]] = []  # next first
        self._threads = 0  # disk workers alive; one leaves when it finds the queue empty
        self._slot = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lora-slot")
        self._dora_write = threading.Lock()  # DoRA writes may add shared bias-shift rows

    def load(
        self,
        key: str,
        folder: Callable[[], tuple[object, bool]],
        check: Callable[[LoraWeights], None],
        slot: int | None,
    ) -> Future:
        """Read adapter ``key`` (``folder()`` → (path, fetched from the store)), ``check`` it
        and, when ``slot`` is given, write it there. Starts at once when a worker is free,
        else waits in the queue (cancel the future to take it out)."""
        fut: Future = Future()
        with self._lock:
            self._queue.append((key, fut, lambda: self._load(folder, check, slot)))
            if self._threads < self.workers:
                self._threads += 1
                threading.Thread(target=self._work, name=f"lora-disk-{self._threads}",
                                 daemon=True).start()
        return fut

    def order(self, keys: list[str]) -> None:
        """Queued loads of ``keys`` start first, in this order; the others keep theirs after
        them (called by the engine thread once per step)."""
        place = {k: i for i, k in enumerate(keys)}
        with self._lock:
            self._queue.sort(key=lambda job: place.get(job[0], len(place)))

    def queued(self) -> list[str]:
        """The loads waiting for a worker, next first."""
        with self._lock:
            return [key for key, fut, _ in self._queue if not fut.cancelled()]

    def _work(self) -> None:
        while True:
            with self._lock:
                if not self._queue:
                    self._threads -= 1
                    return
                _, fut, job = self._queue.pop(0)
            if not fut.set_running_or_notify_cancel():
                continue  # cancelled while it waited
            try:
                fut.set_result(job())
            except BaseException as exc:  # the manager fails this adapter's requests only
                fut.set_exception(exc)

    def write(self, weights: LoraWeights, slot: int) -> Future:
        """Copy CPU-tier weights into the reserved ``slot``."""
        return self._slot.submit(self._write_released, weights, slot)

    def _write_released(self, weights: LoraWeights, slot: int) -> LoadResult:
        """:meth:`_write` on the slot thread, which outlives its writes: its OpenMP pool is
        freed after each (a pool kept beside the engine thread's throttles every step; the
        disk threads' go when they exit, see omp_threads.py)."""
        try:
            return self._write(weights, slot, {})
        finally:
            omp_threads.release_pool()

    def _load(self, folder, check, slot: int | None) -> LoadResult:
        seconds: dict[str, float] = {}
        t0 = time.perf_counter()
        path, fetched = folder()
        t1 = time.perf_counter()
        if fetched:
            seconds["store"] = t1 - t0
        # PEFT's full copies of the embedding layers: compared with the served checkpoint's
        # (an adapter from the registry has none; one handed to the engine directly may)
        base_copies = (local_base_tensor(str(getattr(self.base.model, "path", ""))) or (lambda module: None)
                       ) if self.base is not None else None
        weights = load_adapter(path, dtype=self.cpu_dtype, family=self.family, base_tensor=base_copies)
        check(weights)
        if weights.spec.use_dora:
            if self.base is None:
                raise LoRAError(f"adapter {Path(path).name!r} is a DoRA adapter; this engine has "
                                f"no base projections to scale it against")
            dora_scales(weights, self.base, Path(path).name)
        if self.pin_memory:
            for modules in weights.layers.values():
                for name, (a, b) in modules.items():
                    modules[name] = (a.pin_memory(), b.pin_memory())
        seconds["disk"] = time.perf_counter() - t1
        if slot is None:
            return LoadResult(weights, None, seconds)
        return self._write(weights, slot, seconds)

    def _write(self, weights: LoraWeights, slot: int, seconds: dict[str, float]) -> LoadResult:
        t0 = time.perf_counter()
        with self._dora_write if weights.spec.use_dora else nullcontext():
            self.slots.write(slot, weights)
        seconds["cpu"] = time.perf_counter() - t0
        return LoadResult(weights, slot, seconds)
