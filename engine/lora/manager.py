"""LoRAManager: the adapter manager of an engine with LoRA, a facade over three parts.

* :class:`~loramux.engine.lora.tiers.AdapterTiers` (``tiers``): the known adapters, the CPU
  tier (``max_cpu_loras``) and the background loads from disk or the adapter source, so a
  cold adapter never stalls the engine loop;
* :class:`~loramux.engine.lora.slot_table.SlotTable` (``slots``): ``max_loras`` device slots
  of stacked weights (:class:`SlotBuffers`, as many as the memory holds unless ``max_loras``
  is set, ``capacity.py``), LRU, pins, reservations while a slot is written in the
  background (on CUDA the engine thread enqueues an asynchronous copy instead);
* :class:`~loramux.engine.lora.step.LoRAStepBatch` (``hook``): the step's layout and the
  layer hook, with the kernel chosen once at start.

A slot used by the running batch is never evicted, nor a pinned adapter. The scheduler's
admission (``admission.py``) calls :meth:`acquire` and :meth:`prefetch` and tells
:meth:`note_running`, the runner calls :meth:`prepare_step` and :meth:`finish_step` around
each forward pass and the engine :meth:`poll` between steps; every LoRA layer calls ``hook.add``. Loads are counted and timed per tier
(``load_stats``: store, disk, cpu → slot). Everything runs on the engine thread.

Others watch through public seams only: :meth:`add_listener` hears ``loaded`` (into
CPU memory), ``evicted`` (out of a device slot), ``dropped`` (forgotten) and ``broken``;
:meth:`snapshot` is the residency the admin API shows (``AsyncEngine.lora_snapshot``).
:class:`~loramux.engine.lora.null.NoLoRA` answers the same calls when LoRA is off.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import torch

from loramux.engine.config import LoRAConfig
from loramux.engine.errors import AdapterBrokenError, LoRAError
from loramux.engine.lora import ops
from loramux.engine.lora.capacity import GPU_RESERVE_BYTES, plan_capacity
from loramux.engine.lora.dora import BaseProjections
from loramux.engine.lora.loader import LoadResult, LoadStats
from loramux.engine.lora.slot_table import SlotTable
from loramux.engine.lora.slots import SlotBuffers
from loramux.engine.lora.state import AdapterListener, AdapterState, ResidencySnapshot
from loramux.engine.lora.step import LoRAStepBatch, lay_out_step
from loramux.engine.lora.tiers import AdapterTiers
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


class LoRAManager:
    """Places adapters in tiers and lays out each step's adapters for the layers."""

    enabled = True

    def __init__(
        self,
        config: LoRAConfig,
        model: DecoderModel,
        adapter_source: Callable[[str], str | Path] | None = None,
        gpu_utilization: float = 0.9,
    ) -> None:
        self.config = config
        self.device = model.device
        self.running_keys: frozenset[str] = frozenset()
        """The adapters of the running sequences, as the scheduler last told (never evicted)."""
        # auto: the base projections' matmul dtype (fp32 for bf16 on CPUs without bf16 GEMMs)
        dtype = (matmul_dtype(model.dtype, model.device) if config.lora_dtype == "auto"
                 else getattr(torch, config.lora_dtype))
        # the CPU tier keeps adapters in the model's dtype (bf16: half of fp32 slots' memory)
        cpu_dtype = model.dtype if config.lora_dtype == "auto" else dtype
        self.backend = ops.resolve_backend(config.lora_backend, model.device)
        if config.fully_sharded_loras and model.shard is not None:
            if config.lora_backend == "triton":
                raise ValueError("fully_sharded_loras runs on the torch LoRA backend (its GEMMs read "
                                 "the block-diagonal slots); lora_backend='triton' was asked for")
            self.backend = "torch"
        elif config.fully_sharded_loras:
            logger.warning("fully_sharded_loras has no effect with tensor_parallel_size 1 (one rank "
                           "holds every adapter whole)")
        blockdiag = self.backend == "torch"
        self.capacity = plan_capacity(
            config, model.dims, torch.finfo(dtype).bits // 8,
            cpu_element_size=torch.finfo(cpu_dtype).bits // 8, device_type=model.device.type,
            blockdiag=blockdiag, device_free_bytes=_device_free_bytes(model.device, gpu_utilization),
            scale_element_size=torch.finfo(model.dtype).bits // 8,
        )
        self.max_loras = self.capacity.num_slots
        self.max_cpu_loras = self.capacity.max_cpu_loras
        logger.info(
            "adapter capacity: %d slots (%s), %d in the CPU tier, %.1f MiB per slot; LoRA kernels: %s",
            self.max_loras, "derived from memory" if self.capacity.derived else "max_loras",
            self.max_cpu_loras, self.capacity.slot_bytes / 2**20, self.backend,
        )
        self.buffers = SlotBuffers(  # under tensor parallelism: this rank's share of each slot
            model.local_dims, self.max_loras, config.max_lora_rank, dtype, model.device,
            blockdiag=blockdiag, scale_dtype=model.dtype, shard=model.shard,
            fully_sharded=config.fully_sharded_loras,
        )
        self.buffers.vocab.allowance = self.capacity.adapter_allowance
        self.buffers.vocab.pool = self.capacity.vocab_pool
        self.buffers.norms.base = model.norm_weights() if hasattr(model, "norm_weights") else {}
        self._listeners: list[AdapterListener] = []
        self.hook = LoRAStepBatch(self.buffers, self.backend, model.device)
        """The model's LoRA hook (``LoRAHook``): this step's layout and the layer call."""
        self.slots = SlotTable(self.buffers, self._busy, lambda key: self._emit("evicted", key))
        self.base_projections = BaseProjections(model)
        """What DoRA adapters are scaled against (under tensor parallelism the runner connects
        it to the other ranks: ``gather``)."""
        self.tiers = AdapterTiers(config, model.dims, self.buffers, self.max_cpu_loras, cpu_dtype,
                                  adapter_source, pin_memory=model.device.type == "cuda",
                                  base=self.base_projections)
        self._write_on_loop = model.device.type == "cuda"  # async H2D copy on a side stream

    def _busy(self) -> set[str]:
        return self.running_keys | self.hook.keys

    def note_running(self, lora_keys: set[str]) -> None:
        """The adapters of the running sequences now (the scheduler, after each change)."""
        self.running_keys = frozenset(lora_keys)

    # --- read-only views ----------------------------------------------------------------
    @property
    def slot_of(self) -> Mapping[str, int]:
        """Adapter -> device slot of every resident adapter."""
        return self.slots.slot_of

    @property
    def num_evictions(self) -> int:
        return self.slots.num_evictions

    @property
    def load_stats(self) -> LoadStats:
        return self.tiers.load_stats

    def is_resident(self, key: str) -> bool:
        """True when ``key`` sits in a device slot, ready for a step."""
        return self.slots.is_resident(key)

    def is_loading(self, key: str) -> bool:
        """True while a background load or slot write of ``key`` runs."""
        return key in self.tiers.loading

    def is_evict_pending(self, key: str) -> bool:
        """True when ``key`` leaves its slot once its running requests finish."""
        return key in self.slots.pending

    # --- events -------------------------------------------------------------------------
    def add_listener(self, listener: AdapterListener) -> Callable[[], None]:
        """Call ``listener(event, key)`` on every load, eviction, drop and broken mark (on
        the engine thread: keep it quick). Returns the function that removes it."""
        self._listeners.append(listener)
        return lambda: self._listeners.remove(listener) if listener in self._listeners else None

    def _emit(self, event: str, key: str) -> None:
        for listener in list(self._listeners):
            try:
                listener(event, key)
            except Exception:
                logger.exception("adapter listener failed on %s %s", event, key)

    # --- registration ---------------------------------------------------------------------
    def register(self, request: LoRARequest) -> None:
        """Know an adapter by name; checks its config (rank, targets) synchronously. An
        adapter marked broken is refused (:class:`AdapterBrokenError`) until replaced; a
        name that now points at other weights drops the old ones first."""
        self.tiers.refuse_broken(request)
        state = self.tiers.state(request.key)
        if state is not None and state.request.lora_path != request.lora_path:
            self.drop(request.key)
        self.tiers.register(request)

    def invocation_tokens(self, key: str) -> tuple[int, ...] | None:
        """A registered aLoRA's invocation token ids (None: a plain LoRA); read when a
        request is added, to find where its adapter starts in the prompt."""
        return self._state(key).invocation_tokens

    def drop(self, key: str) -> None:
        """Forget an adapter entirely (deleted or replaced); frees its slot when idle."""
        self.slots.evict(key)
        self.slots.unpin(key)
        known, load = self.tiers.forget(key)
        if load is not None:  # its result is stale; a slot being written frees once it is done
            self.slots.orphan(key, load)
        if known:
            self._emit("dropped", key)

    def failed(self) -> dict[str, Exception]:
        """Adapters whose load failed or that were marked broken, with the error (the
        engine fails their requests before each step)."""
        return self.tiers.failed()

    def mark_broken(self, key: str, error: Exception) -> None:
        """The adapter's outputs became non-finite while serving: evict it (once its rows
        leave the step), fail its other requests with ``error`` (:meth:`failed`), refuse it
        until it is replaced, and tell the listeners (``broken``: the platform audits it)."""
        if not self.tiers.mark_broken(key, error):
            return
        logger.error("adapter %s marked broken: %s", key, error)
        self.slots.unpin(key)
        self.slots.evict(key)
        self._emit("broken", key)

    # --- scheduler gate (AdapterGate) -------------------------------------------------------
    def acquire(self, key: str, in_use: set[str]) -> bool:
        """True when ``key`` is in a device slot now. Else start bringing it in (disk →
        CPU tier → a free slot, or one of an idle adapter not in ``in_use``), in the
        background, and return False: it is ready at a later step, the step never waits."""
        self.poll()
        state = self.tiers.state(key)
        if state is None or state.error is not None:
            return False
        if self.slots.is_resident(key):
            self.slots.touch(key)
            return True
        if key in self.tiers.loading:
            return False
        weights = self.tiers.cpu.get(key)
        if weights is None:  # from disk, straight into an empty slot when there is one
            slot = None if self._write_on_loop else self.slots.empty_slot()
            if slot is not None:
                self.slots.reserve(key, slot)
            self.tiers.start_load(key, slot)
            return False
        slot = self.slots.claim(in_use | {key})
        if slot is None:
            return False
        if self._write_on_loop:
            self.tiers.cpu.move_to_end(key)
            self.buffers.write(slot, weights)
            self._place(key, state, LoadResult(weights, slot, {}))
            return True
        self.slots.reserve(key, slot)
        self.tiers.start_write(key, slot)
        return False

    def prefetch(self, keys: list[str]) -> None:
        """The load order, best first (admission calls it once per step, after its acquires):
        loads of ``keys`` still waiting for a worker start first, in this order; the others
        of ``keys`` load from disk into the CPU tier on idle workers while the current batch
        runs (see ``AdapterTiers.prefetch``)."""
        self.tiers.order_loads(keys)
        self.tiers.prefetch(keys, set(self.slots.slot_of))

    def poll(self, wait: float = 0.0) -> None:
        """Apply finished background loads (CPU tier, device slot) and run the evictions
        whose requests finished (called between steps, and when idle after each command);
        ``wait``: seconds to block for a load when none is done yet."""
        self.slots.run_pending()
        if wait:
            self.tiers.wait(wait)
        for key, fut in self.tiers.finished_loads():
            slot = self.slots.unreserve(key)
            state = self.tiers.state(key)
            exc = fut.exception()
            if (state is None or exc is not None or state.error is not None) and slot is not None:
                self.buffers.clear(slot)  # dropped or marked broken meanwhile, or failed
            if state is None:
                continue
            if exc is not None:
                self.tiers.fail_load(key, exc)
                logger.error("adapter %s failed to load: %s", key, exc)
                continue
            if state.error is not None:  # marked broken while it loaded: it stays out
                continue
            result: LoadResult = fut.result()
            if "disk" in result.seconds:
                state.load_seconds = result.seconds["disk"]
                self.tiers.keep(key, result.weights, self.slots.pinned)
                self._emit("loaded", key)
            if result.slot is not None:
                self._place(key, state, result)
            else:
                self.tiers.load_stats.add(result.seconds)

    def _place(self, key: str, state: AdapterState, result: LoadResult) -> None:
        """``key`` now sits in ``result.slot``: count the load per tier."""
        result.seconds.setdefault("cpu", 0.0)
        state.slot_seconds = result.seconds["cpu"]
        self.tiers.load_stats.add(result.seconds)
        self.slots.place(key, result.slot)

    # --- the step -------------------------------------------------------------------------
    def prepare_step(self, row_lora_keys: Sequence[str | None], row_num_tokens: Sequence[int]) -> None:
        """Lay out this step's adapters for the layers (once per step, before the forward
        pass): the step's tokens in batch order are runs of ``row_num_tokens[i]`` tokens of
        adapter ``row_lora_keys[i]`` (None: none; an aLoRA row's tokens before its start)."""
        lay_out_step(self.buffers, self.hook, self.slots.slot_of, row_lora_keys, row_num_tokens)

    def finish_step(self) -> None:
        """After the forward pass (also a failed one): release the step's slots and run the
        evictions that waited for its rows to leave."""
        self.hook.clear()
        self.slots.run_pending()

    # --- operator actions (admin API) ---------------------------------------------------------
    def evict(self, key: str) -> bool:
        """Free the adapter's device slot now, or once no running request uses it.
        Returns False when it was not in a slot. Pinned adapters are unpinned first."""
        self._state(key)
        self.slots.unpin(key)
        return self.slots.evict(key)

    def pin(self, key: str) -> None:
        """Keep the adapter resident (never evicted); loads it if needed."""
        self._state(key)
        self.slots.pin(key)
        self.warm(key)

    def unpin(self, key: str) -> None:
        """Let the adapter be evicted again."""
        self._state(key)
        self.slots.unpin(key)

    def warm(self, key: str) -> bool:
        """Start loading the adapter into CPU memory (in the background: the engine loop
        never waits on the disk) and, once it is there, place it in a free or evictable
        device slot. Returns True once it sits in a device slot; call again until then."""
        state = self._state(key)
        if self.slots.is_resident(key):
            return True
        self.poll()
        if state.error is not None:
            raise state.error
        return self.acquire(key, set())

    def _state(self, key: str) -> AdapterState:
        state = self.tiers.state(key)
        if state is None:
            raise LoRAError(f"adapter {key!r} is not known to this engine")
        return state

    # --- what the admin pages show -------------------------------------------------------------
    def snapshot(self) -> ResidencySnapshot:
        """The residency as plain data (call on the engine thread)."""
        return ResidencySnapshot(
            self.residency(), self.max_loras, self.num_evictions, True, self.max_cpu_loras,
            self.load_stats.as_dict(),
        )

    def residency(self) -> list[dict]:
        """One entry per known adapter: tier (gpu | cpu | disk), slot, pinned, rank, kind (LoRA |
        DoRA), in use."""
        running = self.running_keys
        device_tier = "gpu" if self.device.type == "cuda" else "device"
        slot_of, cpu = self.slots.slot_of, self.tiers.cpu
        rows = []
        for key, state in self.tiers.adapters.items():
            tier = device_tier if key in slot_of else "cpu" if key in cpu else "disk"
            rows.append(
                {
                    "name": key,
                    "tier": tier,
                    "slot": slot_of.get(key),
                    "pinned": key in self.slots.pinned,
                    "rank": state.rank,
                    "kind": state.kind,
                    "in_use": key in running,
                    "loading": key in self.tiers.loading,
                    "load_seconds": state.load_seconds,
                    "slot_seconds": state.slot_seconds,
                    "error": str(state.error) if state.error else None,
                }
            )
        return rows
