"""LoRAManager: adapter tiers (disk → CPU → device slot) and the per-step LoRA hook.

* Disk: an adapter's folder, from ``LoRARequest.lora_path`` or the adapter source
  (a callable: name → local folder; the registry plugs in here).
* CPU: an LRU of loaded :class:`LoraWeights` (``max_cpu_loras``), filled by a
  background thread so a cold adapter never stalls the engine loop.
* Device: ``max_loras`` slots of stacked weights (:class:`SlotBuffers`).

A slot used by the running batch is never evicted, nor a pinned adapter. The
engine calls :meth:`acquire` (through the scheduler) before admitting a
request, :meth:`prepare_step` once per step, and every layer calls :meth:`add`.

Others watch through public seams only: :meth:`add_listener` hears ``loaded`` (into
CPU memory), ``evicted`` (out of a device slot) and ``dropped`` (forgotten), on the
engine thread; :meth:`snapshot` is the residency the admin API shows, taken on the
engine thread (``AsyncEngine.lora_snapshot``).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch

from loramux.adapters.arch import SUPPORTED_MODULES
from loramux.adapters.errors import AdapterValidationError
from loramux.adapters.format import (
    CONFIG_NAME,
    LoraWeights,
    load_adapter,
    parse_config,
    read_config,
)
from loramux.engine.config import LoRAConfig
from loramux.engine.lora import ops
from loramux.engine.lora.capacity import GPU_RESERVE_BYTES, plan_capacity
from loramux.engine.lora.meta import LoRABatchMeta
from loramux.engine.lora.slots import SlotBuffers
from loramux.engine.lora_request import LoRARequest
from loramux.engine.model.llama import LlamaModel

logger = logging.getLogger(__name__)


class LoRAError(ValueError):
    """An adapter cannot be served (unknown, invalid, or incompatible with the base model)."""


class AdapterBrokenError(LoRAError):
    """The adapter was marked broken (its outputs became non-finite while serving); it is
    refused until it is replaced (another path or id under its name)."""


@dataclass
class AdapterState:
    """What the manager knows of one adapter."""

    request: LoRARequest
    rank: int
    pinned: bool = False
    load_seconds: float | None = None
    error: Exception | None = None


AdapterListener = Callable[[str, str], None]
"""``listener(event, key)``; event is ``loaded`` | ``evicted`` | ``dropped`` | ``broken``."""


@dataclass(frozen=True)
class ResidencySnapshot:
    """The adapters one engine knows, as of one moment (plain data, safe to share)."""

    rows: list[dict] = field(default_factory=list)
    """One per adapter, as :meth:`LoRAManager.residency`."""
    max_loras: int = 0
    """Device slots (derived from memory unless ``max_loras`` was set)."""
    num_evictions: int = 0
    lora_enabled: bool = False
    max_cpu_loras: int | None = None
    """Adapters the CPU tier holds."""

    def knows(self, key: str) -> bool:
        return any(r["name"] == key for r in self.rows)


def _device_free_bytes(device: torch.device, utilization: float) -> int | None:
    """CUDA: what the engine may still allocate (``total * utilization - used - reserve``)."""
    if device.type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(device)
    return int(total * utilization - (total - free) - GPU_RESERVE_BYTES)


class LoRAManager:
    """Places adapters in tiers and adds their deltas during the forward pass."""

    enabled = True

    def __init__(
        self,
        config: LoRAConfig,
        model: LlamaModel,
        adapter_source: Callable[[str], str | Path] | None = None,
        running_keys: Callable[[], set[str]] | None = None,
        gpu_utilization: float = 0.9,
    ) -> None:
        self.config = config
        self.model = model
        self.source = adapter_source
        self.running_keys = running_keys or (lambda: set())
        dtype = model.dtype if config.lora_dtype == "auto" else getattr(torch, config.lora_dtype)
        self.backend = ops.resolve_backend(config.lora_backend, model.device)
        blockdiag = self.backend == "torch"
        self.capacity = plan_capacity(
            config, model.dims, torch.finfo(dtype).bits // 8, device_type=model.device.type,
            blockdiag=blockdiag, device_free_bytes=_device_free_bytes(model.device, gpu_utilization),
        )
        self.max_loras = self.capacity.num_slots
        self.max_cpu_loras = self.capacity.max_cpu_loras
        logger.info(
            "adapter capacity: %d slots (%s), %d in the CPU tier, %.1f MiB per slot",
            self.max_loras, "derived from memory" if self.capacity.derived else "max_loras",
            self.max_cpu_loras, self.capacity.slot_bytes / 2**20,
        )
        self.slots = SlotBuffers(
            model.dims, self.max_loras, config.max_lora_rank, dtype, model.device,
            blockdiag=blockdiag,
        )
        self.adapters: dict[str, AdapterState] = {}
        self.slot_of: dict[str, int] = {}
        self.slot_lru: OrderedDict[str, None] = OrderedDict()  # device residency, oldest first
        self.cpu: OrderedDict[str, LoraWeights] = OrderedDict()  # CPU tier, oldest first
        self.loading: dict[str, Future] = {}
        self.evict_pending: set[str] = set()
        self.num_evictions = 0
        self._listeners: list[AdapterListener] = []
        self._loader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lora-loader")
        self._meta: LoRABatchMeta | None = None
        self._groups: frozenset[str] = frozenset()
        self._step_keys: set[str] = set()
        self.broken: dict[str, tuple[LoRARequest, Exception]] = {}
        """Adapters marked broken (:meth:`mark_broken`) and the request that named them."""

    # --- events -----------------------------------------------------------------------
    def add_listener(self, listener: AdapterListener) -> Callable[[], None]:
        """Call ``listener(event, key)`` on every load, eviction and drop (on the engine
        thread: keep it quick). Returns the function that removes it."""
        self._listeners.append(listener)
        return lambda: self._listeners.remove(listener) if listener in self._listeners else None

    def _emit(self, event: str, key: str) -> None:
        for listener in list(self._listeners):
            try:
                listener(event, key)
            except Exception:
                logger.exception("adapter listener failed on %s %s", event, key)

    # --- registration ---------------------------------------------------------------
    def register(self, request: LoRARequest) -> None:
        """Know an adapter by name; checks its config (rank, targets) synchronously. An
        adapter marked broken is refused (:class:`AdapterBrokenError`) until replaced."""
        broken = self.broken.get(request.key)
        if broken is not None:
            if broken[0] == request:
                raise AdapterBrokenError(
                    f"adapter {request.lora_name!r} is marked broken: {broken[1]}") from None
            del self.broken[request.key]  # replaced: the name points at other weights
        state = self.adapters.get(request.key)
        if state is not None and state.request == request and state.error is None:
            return
        if state is not None and state.request.lora_path != request.lora_path:
            self.drop(request.key)  # the name now points at other weights
        folder = self._folder(request)
        try:
            spec = parse_config(read_config(folder / CONFIG_NAME))
        except AdapterValidationError as e:
            raise LoRAError(f"adapter {request.lora_name!r}: {e}") from None
        if spec.r > self.config.max_lora_rank:
            raise LoRAError(
                f"adapter {request.lora_name!r} has rank {spec.r}, above max_lora_rank="
                f"{self.config.max_lora_rank}"
            )
        unsupported = [m for m in spec.target_modules if m not in SUPPORTED_MODULES]
        if unsupported:
            raise LoRAError(
                f"adapter {request.lora_name!r} targets unsupported modules {unsupported}"
            )
        self.adapters[request.key] = AdapterState(request, spec.r)

    def _folder(self, request: LoRARequest) -> Path:
        if request.lora_path is not None:
            path = Path(request.lora_path)
        elif self.source is not None:
            path = Path(self.source(request.lora_name))
        else:
            raise LoRAError(f"adapter {request.lora_name!r} has no lora_path and no adapter source")
        if not path.is_dir():
            raise LoRAError(f"adapter {request.lora_name!r}: {path} is not a folder")
        return path

    def drop(self, key: str) -> None:
        """Forget an adapter entirely (deleted or replaced); frees its slot when idle."""
        if key in self.running_keys() or key in self._step_keys:
            self.evict_pending.add(key)
        else:
            self._free_slot(key)
        self.cpu.pop(key, None)
        if self.adapters.pop(key, None) is not None:
            self._emit("dropped", key)

    # --- scheduler gate --------------------------------------------------------------
    def acquire(self, key: str, in_use: set[str]) -> bool:
        """True when ``key`` is in a device slot now; else start loading it and return False."""
        self.poll()
        state = self.adapters.get(key)
        if state is None or state.error is not None:
            return False
        if key in self.slot_of:
            self.slot_lru.move_to_end(key)
            return True
        weights = self.cpu.get(key)
        if weights is None:
            self._start_load(key)
            return False
        slot = self._free_or_evictable_slot(in_use | {key})
        if slot is None:
            return False
        self.slots.write(slot, weights)
        self.slot_of[key] = slot
        self.slot_lru[key] = None
        self.cpu.move_to_end(key)
        return True

    def failed(self) -> dict[str, Exception]:
        """Adapters whose load failed, with the error (the engine fails their requests)."""
        return {k: s.error for k, s in self.adapters.items() if s.error is not None}

    def mark_broken(self, key: str, error: Exception) -> None:
        """The adapter's outputs became non-finite while serving: evict it (once its rows
        leave the step), fail its other requests with ``error`` (:meth:`failed`), refuse it
        until it is replaced, and tell the listeners (``broken``: the platform audits it)."""
        state = self.adapters.get(key)
        if state is None or key in self.broken:
            return
        logger.error("adapter %s marked broken: %s", key, error)
        self.broken[key] = (state.request, error)
        state.error = error
        state.pinned = False
        self.cpu.pop(key, None)
        self.evict(key)
        self._emit("broken", key)

    def _free_or_evictable_slot(self, protected: set[str]) -> int | None:
        used = set(self.slot_of.values())
        for slot in range(self.max_loras):
            if slot not in used:
                return slot
        busy = protected | self.running_keys() | self._step_keys
        for key in self.slot_lru:  # least recently used first
            state = self.adapters.get(key)
            if key in busy or (state is not None and state.pinned):
                continue
            slot = self.slot_of[key]
            self._free_slot(key)
            return slot
        return None

    def _free_slot(self, key: str) -> None:
        slot = self.slot_of.pop(key, None)
        self.slot_lru.pop(key, None)
        if slot is not None:
            self.slots.clear(slot)
            self.num_evictions += 1
            self._emit("evicted", key)

    # --- loading ---------------------------------------------------------------------
    def _start_load(self, key: str) -> None:
        if key in self.loading:
            return
        request = self.adapters[key].request
        self.loading[key] = self._loader.submit(self._load, request)

    def _load(self, request: LoRARequest) -> tuple[LoraWeights, float]:
        t0 = time.perf_counter()
        weights = load_adapter(self._folder(request), dtype=self.slots.a[0]["qkv"].dtype)
        self._check_shapes(request, weights)
        if self.model.device.type == "cuda":
            for modules in weights.layers.values():
                for name, (a, b) in modules.items():
                    modules[name] = (a.pin_memory(), b.pin_memory())
        return weights, time.perf_counter() - t0

    def _check_shapes(self, request: LoRARequest, weights: LoraWeights) -> None:
        shapes = self.model.dims.module_shapes()
        for layer, modules in weights.layers.items():
            if layer >= self.model.dims.num_layers:
                raise LoRAError(
                    f"adapter {request.lora_name!r} has layer {layer}; the base model has "
                    f"{self.model.dims.num_layers}"
                )
            for name, (a, b) in modules.items():
                k, n = shapes[name]
                if a.shape[1] != k or b.shape[0] != n:
                    raise LoRAError(
                        f"adapter {request.lora_name!r}: {name} of layer {layer} is "
                        f"{tuple(b.shape[:1]) + tuple(a.shape[1:])} (out, in); the base model "
                        f"needs ({n}, {k})"
                    )

    def poll(self, wait: float = 0.0) -> None:
        """Move finished background loads into the CPU tier and run the evictions whose
        requests finished (called between steps, and when idle after each command)."""
        self._run_pending_evictions()
        if wait and self.loading and not any(f.done() for f in self.loading.values()):
            futures.wait(
                list(self.loading.values()), timeout=wait, return_when=futures.FIRST_COMPLETED
            )
        for key, fut in list(self.loading.items()):
            if not fut.done():
                continue
            del self.loading[key]
            state = self.adapters.get(key)
            if state is None:
                continue
            exc = fut.exception()
            if exc is not None:
                state.error = (
                    exc
                    if isinstance(exc, (LoRAError, AdapterValidationError))
                    else LoRAError(f"adapter {key!r} failed to load: {exc}")
                )
                logger.error("adapter %s failed to load: %s", key, exc)
                continue
            weights, seconds = fut.result()
            state.load_seconds = seconds
            self.cpu[key] = weights
            self._trim_cpu()
            self._emit("loaded", key)

    def _trim_cpu(self) -> None:
        while len(self.cpu) > self.max_cpu_loras:
            for key in self.cpu:
                state = self.adapters.get(key)
                if state is None or not state.pinned:
                    self.cpu.pop(key)
                    break
            else:
                return

    # --- per-step hook (LoRAHook) -----------------------------------------------------
    def prepare_step(self, token_lora_keys: list[str | None]) -> None:
        """Build this step's LoRABatchMeta from each token's adapter (called once per step)."""
        keys = {k for k in token_lora_keys if k is not None}
        self._step_keys = keys
        if not keys:
            self._meta = None
            return
        self.slots.wait_ready()
        slots = [self.slot_of[k] if k is not None else -1 for k in token_lora_keys]
        self._meta = LoRABatchMeta.build(slots, self.slots.ranks, self.model.device)
        # Groups no adapter of this step targets are skipped (e.g. q/v-only adapters).
        self._groups = frozenset().union(*(self.slots.groups[self.slot_of[k]] for k in keys))

    def finish_step(self) -> None:
        """Release step-scoped state; run evictions that waited for the batch to drain."""
        self._step_keys = set()
        self._meta = None
        self._run_pending_evictions()

    def _run_pending_evictions(self) -> None:
        if self.evict_pending:
            running = self.running_keys() | self._step_keys
            for key in list(self.evict_pending):
                if key not in running:
                    self._free_slot(key)
                    self.evict_pending.discard(key)

    def active(self) -> bool:
        return self._meta is not None and self._meta.has_lora

    def add(self, layer: int, group: str, x: torch.Tensor, y: torch.Tensor) -> None:
        if group not in self._groups:
            return
        blockdiag = self.slots.blockdiag  # A pre-scaled: no per-slot scale
        ops.add_lora(
            y,
            x,
            self.slots.a[layer][group],
            self.slots.b[layer][group],
            self._meta,
            None if blockdiag else self.slots.scale,
            self.slots.slice_offsets[group],
            backend=self.backend,
            blockdiag=blockdiag,
        )

    # --- operator actions (admin API) --------------------------------------------------
    def evict(self, key: str) -> bool:
        """Free the adapter's device slot now, or once no running request uses it.
        Returns False when it was not in a slot. Pinned adapters are unpinned first."""
        state = self._state(key)
        state.pinned = False
        if key not in self.slot_of:
            return False
        if key in self.running_keys() or key in self._step_keys:
            self.evict_pending.add(key)
        else:
            self._free_slot(key)
        return True

    def pin(self, key: str) -> None:
        """Keep the adapter resident (never evicted); loads it if needed."""
        self._state(key).pinned = True
        self.warm(key)

    def unpin(self, key: str) -> None:
        self._state(key).pinned = False

    def warm(self, key: str) -> bool:
        """Start loading the adapter into CPU memory (in the background: the engine loop
        never waits on the disk) and, once it is there, place it in a free or evictable
        device slot. Returns True once it sits in a device slot; call again until then."""
        self._state(key)
        if key in self.slot_of:
            return True
        self.poll()
        if key not in self.cpu:
            self._start_load(key)
            return False
        state = self.adapters[key]
        if state.error is not None:
            raise state.error
        return self.acquire(key, set())

    def _state(self, key: str) -> AdapterState:
        state = self.adapters.get(key)
        if state is None:
            raise LoRAError(f"adapter {key!r} is not known to this engine")
        return state

    def snapshot(self) -> ResidencySnapshot:
        """The residency as plain data (call on the engine thread)."""
        return ResidencySnapshot(
            self.residency(), self.max_loras, self.num_evictions, True, self.max_cpu_loras
        )

    def residency(self) -> list[dict]:
        """One entry per known adapter: tier (gpu | cpu | disk), slot, pinned, rank, in use."""
        running = self.running_keys()
        device_tier = "gpu" if self.model.device.type == "cuda" else "device"
        rows = []
        for key, state in self.adapters.items():
            if key in self.slot_of:
                tier = device_tier
            elif key in self.cpu:
                tier = "cpu"
            else:
                tier = "disk"
            rows.append(
                {
                    "name": key,
                    "tier": tier,
                    "slot": self.slot_of.get(key),
                    "pinned": state.pinned,
                    "rank": state.rank,
                    "in_use": key in running,
                    "loading": key in self.loading,
                    "load_seconds": state.load_seconds,
                    "error": str(state.error) if state.error else None,
                }
            )
        return rows
