"""LoRAManager: adapter tiers (disk → CPU → device slot) and the per-step LoRA hook.

* Disk: an adapter's folder, from ``LoRARequest.lora_path`` or the adapter source
  (a callable: name → local folder; the registry plugs in here).
* CPU: an LRU of loaded :class:`LoraWeights` (``max_cpu_loras``), filled by a
  background thread so a cold adapter never stalls the engine loop.
* Device: ``max_loras`` slots of stacked weights (:class:`SlotBuffers`), as many as the
  memory holds unless ``max_loras`` is set (``capacity.py``). On the CPU device a slot is
  written in the background too (``loader.py``): the slot is reserved meanwhile and no
  step reads it; on CUDA the engine thread enqueues an asynchronous copy.

A slot used by the running batch is never evicted, nor a pinned adapter. The
scheduler's admission (``admission.py``) calls :meth:`acquire` and :meth:`prefetch`,
the engine :meth:`prepare_step` once per step, and every layer calls :meth:`add`
(``step.py``).
Loads are counted and timed per tier (``load_stats``: store, disk, cpu → slot).

Others watch through public seams only: :meth:`add_listener` hears ``loaded`` (into
CPU memory), ``evicted`` (out of a device slot) and ``dropped`` (forgotten), on the
engine thread; :meth:`snapshot` is the residency the admin API shows, taken on the
engine thread (``AsyncEngine.lora_snapshot``).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable
from concurrent import futures
from concurrent.futures import Future
from pathlib import Path

import torch

from loramux.adapters.archive import CONFIG_NAME
from loramux.adapters.errors import AdapterValidationError
from loramux.adapters.format import LoraWeights
from loramux.adapters.spec import parse_config, read_config
from loramux.engine.config import LoRAConfig
from loramux.engine.errors import AdapterBrokenError, LoRAError
from loramux.engine.lora import ops
from loramux.engine.lora.capacity import GPU_RESERVE_BYTES, plan_capacity
from loramux.engine.lora.loader import AdapterLoader, LoadResult, LoadStats
from loramux.engine.lora.meta import LoRABatchMeta
from loramux.engine.lora.operator import OperatorActions
from loramux.engine.lora.slots import SlotBuffers
from loramux.engine.lora.state import AdapterListener, AdapterState, ResidencySnapshot
from loramux.engine.lora.step import StepHook
from loramux.engine.lora_request import LoRARequest
from loramux.engine.model.decoder import DecoderModel
from loramux.engine.model.linear import matmul_dtype

logger = logging.getLogger(__name__)

__all__ = ["AdapterBrokenError", "AdapterListener", "AdapterState", "LoRAError", "LoRAManager", "ResidencySnapshot"]


def _device_free_bytes(device: torch.device, utilization: float) -> int | None:
    """CUDA: what the engine may still allocate (``total * utilization - used - reserve``)."""
    if device.type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(device)
    return int(total * utilization - (total - free) - GPU_RESERVE_BYTES)


class LoRAManager(OperatorActions, StepHook):
    """Places adapters in tiers and adds their deltas during the forward pass."""

    enabled = True

    def __init__(
        self,
        config: LoRAConfig,
        model: DecoderModel,
        adapter_source: Callable[[str], str | Path] | None = None,
        running_keys: Callable[[], set[str]] | None = None,
        gpu_utilization: float = 0.9,
    ) -> None:
        self.config = config
        self.model = model
        self.source = adapter_source
        self.running_keys = running_keys or (lambda: set())
        # auto: the base projections' matmul dtype (fp32 for bf16 on CPUs without bf16 GEMMs)
        dtype = (matmul_dtype(model.dtype, model.device) if config.lora_dtype == "auto"
                 else getattr(torch, config.lora_dtype))
        # the CPU tier keeps adapters in the model's dtype (bf16: half of fp32 slots' memory)
        cpu_dtype = model.dtype if config.lora_dtype == "auto" else dtype
        self.backend = ops.resolve_backend(config.lora_backend, model.device)
        blockdiag = self.backend == "torch"
        self.capacity = plan_capacity(
            config, model.dims, torch.finfo(dtype).bits // 8,
            cpu_element_size=torch.finfo(cpu_dtype).bits // 8, device_type=model.device.type,
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
        self.reserved: dict[str, int] = {}  # slots being written in the background
        self._stale: list[tuple[Future, int | None]] = []  # loads of dropped adapters
        self.evict_pending: set[str] = set()
        self.num_evictions = 0
        self.load_stats = LoadStats()
        self._listeners: list[AdapterListener] = []
        self._loader = AdapterLoader(self.slots, cpu_dtype, pin_memory=model.device.type == "cuda",
                                     family=model.dims)
        self._write_on_loop = model.device.type == "cuda"  # async H2D copy on a side stream
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
            spec = parse_config(read_config(folder / CONFIG_NAME), self.model.dims)
        except AdapterValidationError as e:
            raise LoRAError(f"adapter {request.lora_name!r}: {e}") from None
        if spec.r > self.config.max_lora_rank:
            raise LoRAError(
                f"adapter {request.lora_name!r} has rank {spec.r}, above max_lora_rank="
                f"{self.config.max_lora_rank}"
            )
        unsupported = [m for m in spec.target_modules if m not in self.model.family.lora_modules]
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
        fut = self.loading.pop(key, None)
        if fut is not None:  # its result is stale; a slot being written frees once it is done
            self._stale.append((fut, self.reserved.pop(key, None)))
        if self.adapters.pop(key, None) is not None:
            self._emit("dropped", key)

    # --- scheduler gate --------------------------------------------------------------
    def acquire(self, key: str, in_use: set[str]) -> bool:
        """True when ``key`` is in a device slot now. Else start bringing it in (disk →
        CPU tier → a free slot, or one of an idle adapter not in ``in_use``), in the
        background, and return False: it is ready at a later step, the step never waits."""
        self.poll()
        state = self.adapters.get(key)
        if state is None or state.error is not None:
            return False
        if key in self.slot_of:
            self.slot_lru.move_to_end(key)
            return True
        if key in self.loading:
            return False
        weights = self.cpu.get(key)
        if weights is None:  # from disk, straight into an empty slot when there is one
            self._start_load(key, self._empty_slot() if not self._write_on_loop else None)
            return False
        slot = self._free_or_evictable_slot(in_use | {key})
        if slot is None:
            return False
        self.cpu.move_to_end(key)
        if self._write_on_loop:
            result = LoadResult(weights, slot, {})
            self.slots.write(slot, weights)
            self._place(key, state, result)
            return True
        self.reserved[key] = slot
        self.loading[key] = self._loader.write(weights, slot)
        return False

    def is_resident(self, key: str) -> bool:
        """True when ``key`` sits in a device slot, ready for a step."""
        return key in self.slot_of

    def prefetch(self, keys: list[str]) -> None:
        """Load these adapters (best first) from disk into the CPU tier in the background,
        while the current batch runs; at most two loads in flight, never past the CPU tier."""
        wanted = set(keys) | set(self.slot_of)  # CPU-tier copies prefetch must not push out
        for key in keys:
            room = self.max_cpu_loras - len(self.loading) - len(wanted.intersection(self.cpu))
            if len(self.loading) >= 2 or room <= 0:
                return
            state = self.adapters.get(key)
            if state is None or state.error is not None:
                continue
            if key not in self.slot_of and key not in self.cpu and key not in self.loading:
                self._start_load(key, None)

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

    def _empty_slot(self) -> int | None:
        used = set(self.slot_of.values()) | set(self.reserved.values())
        used |= {slot for _, slot in self._stale}
        return next((s for s in range(self.max_loras) if s not in used), None)

    def _free_or_evictable_slot(self, protected: set[str]) -> int | None:
        slot = self._empty_slot()
        if slot is not None:
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
    def _start_load(self, key: str, slot: int | None) -> None:
        request = self.adapters[key].request
        if slot is not None:
            self.reserved[key] = slot

        def folder() -> tuple[Path, bool]:
            return self._folder(request), request.lora_path is None

        self.loading[key] = self._loader.load(
            folder, lambda w: self._check_shapes(request, w), slot
        )

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
        """Apply finished background loads (CPU tier, device slot) and run the evictions
        whose requests finished (called between steps, and when idle after each command)."""
        self._run_pending_evictions()
        for fut, slot in [x for x in self._stale if x[0].done()]:
            self._stale.remove((fut, slot))
            if slot is not None:
                self.slots.clear(slot)
        if wait and self.loading and not any(f.done() for f in self.loading.values()):
            futures.wait(
                list(self.loading.values()), timeout=wait, return_when=futures.FIRST_COMPLETED
            )
        for key, fut in list(self.loading.items()):
            if not fut.done():
                continue
            del self.loading[key]
            slot = self.reserved.pop(key, None)
            state = self.adapters.get(key)
            exc = fut.exception()
            if state is None or exc is not None or state.error is not None:
                if slot is not None:  # dropped or marked broken meanwhile, or failed
                    self.slots.clear(slot)
            if state is None:
                continue
            if exc is not None:
                state.error = (  # what the adapter's requests fail with
                    exc if isinstance(exc, LoRAError)
                    else LoRAError(f"adapter {key!r} failed to load: {exc}")
                )
                logger.error("adapter %s failed to load: %s", key, exc)
                continue
            if state.error is not None:  # marked broken while it loaded: it stays out
                continue
            result: LoadResult = fut.result()
            if "disk" in result.seconds:
                state.load_seconds = result.seconds["disk"]
                self.cpu[key] = result.weights
                self._trim_cpu()
                self._emit("loaded", key)
            if result.slot is not None:
                self._place(key, state, result)
            else:
                self.load_stats.add(result.seconds)

    def _place(self, key: str, state: AdapterState, result: LoadResult) -> None:
        """``key`` now sits in ``result.slot``: count the load per tier."""
        result.seconds.setdefault("cpu", 0.0)
        state.slot_seconds = result.seconds["cpu"]
        self.load_stats.add(result.seconds)
        self.slot_of[key] = result.slot
        self.slot_lru[key] = None

    def _trim_cpu(self) -> None:
        while len(self.cpu) > self.max_cpu_loras:
            for key in self.cpu:
                state = self.adapters.get(key)
                if state is None or not state.pinned:
                    self.cpu.pop(key)
                    break
            else:
                return
