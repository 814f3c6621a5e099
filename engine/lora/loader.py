"""Background adapter loads, off the engine loop, timed per tier.

Two single-thread executors, so a slow disk never queues a slot write behind it:

* ``disk``: store/disk → CPU tier (``load_adapter``, shape checks, a DoRA adapter's per-row
  scales against the base (``dora.py``), pinned memory on CUDA),
  optionally followed by the write into a device slot reserved for it;
* ``slot``: CPU tier → a reserved device slot (the CPU device: a copy into the stacked slot
  buffers; on CUDA the engine thread enqueues the asynchronous copy itself).

A job returns a :class:`LoadResult`; the manager applies it on the engine thread
(``LoRAManager.poll``). A slot being written is reserved: no step reads it, nothing else
takes it, until the result is applied.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch

from loramux.adapters.format import LoraWeights, load_adapter
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
    """Runs disk loads and slot writes on their own threads."""

    def __init__(
        self, slots: SlotBuffers, cpu_dtype: torch.dtype, pin_memory: bool, family=None,
        base: BaseProjections | None = None,
    ) -> None:
        """``base``: the served projections a DoRA adapter's scales are computed against
        (None: DoRA adapters fail to load)."""
        self.slots = slots
        self.base = base
        self.family = family  # the base's dims: what all-linear means
        self.cpu_dtype = cpu_dtype
        self.pin_memory = pin_memory
        self._disk = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lora-disk")
        self._slot = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lora-slot")

    def load(
        self,
        folder: Callable[[], tuple[object, bool]],
        check: Callable[[LoraWeights], None],
        slot: int | None,
    ) -> Future:
        """Read an adapter (``folder()`` → (path, fetched from the store)), ``check`` it and,
        when ``slot`` is given, write it there."""
        return self._disk.submit(self._load, folder, check, slot)

    def write(self, weights: LoraWeights, slot: int) -> Future:
        """Copy CPU-tier weights into the reserved ``slot``."""
        return self._slot.submit(self._write, weights, slot, {})

    def _load(self, folder, check, slot: int | None) -> LoadResult:
        seconds: dict[str, float] = {}
        t0 = time.perf_counter()
        path, fetched = folder()
        t1 = time.perf_counter()
        if fetched:
            seconds["store"] = t1 - t0
        weights = load_adapter(path, dtype=self.cpu_dtype, family=self.family)
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
        self.slots.write(slot, weights)
        seconds["cpu"] = time.perf_counter() - t0
        return LoadResult(weights, slot, seconds)
