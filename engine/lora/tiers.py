"""Adapter tiers off the device: what the engine knows of each adapter and where its weights
are before they reach a slot.

* Registration: an adapter's folder, from ``LoRARequest.lora_path`` or the adapter source (a
  callable: name → local folder; the registry plugs in here), its config checked against
  ``max_lora_rank`` and the supported modules; adapters marked broken are refused until
  replaced.
* CPU tier: an LRU of loaded :class:`LoraWeights` (``max_cpu_loras``; pinned adapters stay).
* Loads: background jobs (:class:`AdapterLoader`'s threads) that read an adapter into the
  CPU tier, optionally straight into a reserved device slot, or copy a CPU-tier adapter
  into one; at most ``lora_load_workers`` (capped by the CPU tier's size) read at once, the
  others wait in the order :meth:`order_loads` gives; finished jobs are collected on the
  engine thread (:meth:`finished_loads`) and counted per tier (``load_stats``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator
from concurrent import futures
from concurrent.futures import Future
from pathlib import Path

import torch

from loramux.adapters import experts
from loramux.adapters.archive import CONFIG_NAME
from loramux.adapters.errors import AdapterValidationError
from loramux.adapters.format import LoraWeights
from loramux.adapters.spec import parse_config, read_config
from loramux.engine.config import LoRAConfig
from loramux.engine.errors import AdapterBrokenError, LoRAError
from loramux.engine.lora.loader import AdapterLoader, LoadStats
from loramux.engine.lora.slots import SlotBuffers
from loramux.engine.lora.state import AdapterState
from loramux.engine.lora_request import LoRARequest
from loramux.engine.model.weights import ModelDims


class AdapterTiers:
    """Known adapters, the CPU tier and the background loads (engine thread)."""

    def __init__(
        self,
        config: LoRAConfig,
        dims: ModelDims,
        buffers: SlotBuffers,
        max_cpu_loras: int,
        cpu_dtype: torch.dtype,
        adapter_source: Callable[[str], str | Path] | None = None,
        pin_memory: bool = False,
        base=None,
    ) -> None:
        """``base``: the served model's :class:`~loramux.engine.lora.dora.BaseProjections`
        (what DoRA adapters are scaled against)."""
        self.config = config
        self.dims = dims
        self.source = adapter_source
        self.max_cpu_loras = max_cpu_loras
        self.cpu_dtype = cpu_dtype
        """The dtype adapters are kept in, in the CPU tier."""
        self.adapters: dict[str, AdapterState] = {}
        self.broken: dict[str, tuple[LoRARequest, Exception]] = {}
        """Adapters marked broken (:meth:`mark_broken`) and the request that named them."""
        self.cpu: OrderedDict[str, LoraWeights] = OrderedDict()  # CPU tier, oldest first
        self.loading: dict[str, Future] = {}
        """Loads running or queued for a worker, and slot writes (key → its job)."""
        self.load_stats = LoadStats()
        self.load_workers = min(config.lora_load_workers, max_cpu_loras)
        """Disk loads that run at once: their weights are held beside the CPU tier's."""
        self._loader = AdapterLoader(buffers, cpu_dtype, pin_memory=pin_memory, family=dims,
                                     base=base, workers=self.load_workers)

    # --- registration --------------------------------------------------------------------
    def state(self, key: str) -> AdapterState | None:
        return self.adapters.get(key)

    def refuse_broken(self, request: LoRARequest) -> None:
        """Raise :class:`AdapterBrokenError` when ``request`` names an adapter marked broken;
        a broken adapter's name now pointing at other weights is forgiven."""
        broken = self.broken.get(request.key)
        if broken is None:
            return
        if broken[0] == request:
            raise AdapterBrokenError(
                f"adapter {request.lora_name!r} is marked broken: {broken[1]}") from None
        del self.broken[request.key]  # replaced: the name points at other weights

    def register(self, request: LoRARequest) -> None:
        """Know an adapter by name; checks its config (rank, targets) synchronously. Nothing
        happens when it is known already, healthy, with the same request."""
        state = self.adapters.get(request.key)
        if state is not None and state.request == request and state.error is None:
            return
        folder = self.folder(request)
        try:
            spec = parse_config(read_config(folder / CONFIG_NAME), self.dims)
        except AdapterValidationError as e:
            raise LoRAError(f"adapter {request.lora_name!r}: {e}") from None
        if spec.max_rank > self.config.max_lora_rank:
            raise LoRAError(
                f"adapter {request.lora_name!r} has rank {spec.max_rank}, above max_lora_rank="
                f"{self.config.max_lora_rank}"
            )
        unsupported = [m for m in spec.target_modules if m not in self.dims.family.lora_modules]
        if unsupported:
            raise LoRAError(
                f"adapter {request.lora_name!r} targets unsupported modules {unsupported}"
            )
        self.adapters[request.key] = AdapterState(request, spec.r, spec.kind, spec.alora_invocation_tokens)

    def folder(self, request: LoRARequest) -> Path:
        """The adapter's local folder (asks the adapter source when it has no path)."""
        if request.lora_path is not None:
            path = Path(request.lora_path)
        elif self.source is not None:
            path = Path(self.source(request.lora_name))
        else:
            raise LoRAError(f"adapter {request.lora_name!r} has no lora_path and no adapter source")
        if not path.is_dir():
            raise LoRAError(f"adapter {request.lora_name!r}: {path} is not a folder")
        return path

    def forget(self, key: str) -> tuple[bool, Future | None]:
        """Drop the adapter and its CPU-tier copy; returns (it was known, its load still in
        flight, whose result is stale now; one still queued is cancelled)."""
        self.cpu.pop(key, None)
        load = self.loading.pop(key, None)
        if load is not None:
            load.cancel()
        return self.adapters.pop(key, None) is not None, load

    def mark_broken(self, key: str, error: Exception) -> bool:
        """Record ``error`` on a known adapter and drop its CPU-tier copy; False when it is
        unknown or broken already."""
        state = self.adapters.get(key)
        if state is None or key in self.broken:
            return False
        self.broken[key] = (state.request, error)
        state.error = error
        self.cpu.pop(key, None)
        return True

    def failed(self) -> dict[str, Exception]:
        """Adapters whose load failed (or that were marked broken), with the error."""
        return {k: s.error for k, s in self.adapters.items() if s.error is not None}

    # --- loads ---------------------------------------------------------------------------
    def start_load(self, key: str, slot: int | None) -> None:
        """Read ``key`` from its folder into the CPU tier in the background and, when a
        reserved ``slot`` is given, on into that slot; it waits for a worker when all are busy."""
        request = self.adapters[key].request

        def folder() -> tuple[Path, bool]:
            return self.folder(request), request.lora_path is None

        self.loading[key] = self._loader.load(key, folder, lambda w: self._check_shapes(request, w),
                                              slot)

    def order_loads(self, keys: list[str]) -> None:
        """Loads of ``keys`` still waiting for a worker start first, in this order (best
        first); the other waiting ones follow in their own order."""
        self._loader.order(keys)

    def queued_loads(self) -> list[str]:
        """Loads waiting for a worker, next first."""
        return self._loader.queued()

    def start_write(self, key: str, slot: int) -> None:
        """Copy ``key``'s CPU-tier weights into the reserved ``slot`` in the background."""
        self.cpu.move_to_end(key)
        self.loading[key] = self._loader.write(self.cpu[key], slot)

    def prefetch(self, keys: list[str], resident: set[str]) -> None:
        """Load these adapters (best first) from disk into the CPU tier in the background, on
        workers no other load waits for (at most :attr:`load_workers` loads in flight or
        queued), never past the CPU tier's room (CPU-tier copies of ``resident`` adapters and
        of ``keys`` are not pushed out)."""
        wanted = set(keys) | resident
        for key in keys:
            room = self.max_cpu_loras - len(self.loading) - len(wanted.intersection(self.cpu))
            if len(self.loading) >= self.load_workers or room <= 0:
                return
            state = self.adapters.get(key)
            if state is None or state.error is not None:
                continue
            if key not in resident and key not in self.cpu and key not in self.loading:
                self.start_load(key, None)

    def wait(self, timeout: float) -> None:
        """Block up to ``timeout`` seconds for a load to finish (when idle)."""
        if self.loading and not any(f.done() for f in self.loading.values()):
            futures.wait(list(self.loading.values()), timeout=timeout,
                         return_when=futures.FIRST_COMPLETED)

    def finished_loads(self) -> Iterator[tuple[str, Future]]:
        """The loads that are done, each handed out once (``key``, its future)."""
        for key, fut in list(self.loading.items()):
            if fut.done():
                del self.loading[key]
                yield key, fut

    def fail_load(self, key: str, exc: BaseException) -> None:
        """A load of ``key`` failed: the error its requests fail with from now on."""
        self.adapters[key].error = (
            exc if isinstance(exc, LoRAError) else LoRAError(f"adapter {key!r} failed to load: {exc}")
        )

    def keep(self, key: str, weights: LoraWeights, pinned: set[str]) -> None:
        """``key``'s weights joined the CPU tier; the oldest unpinned copies leave past
        ``max_cpu_loras``."""
        self.cpu[key] = weights
        while len(self.cpu) > self.max_cpu_loras:
            unpinned = next((k for k in self.cpu if k not in pinned), None)
            if unpinned is None:
                return
            self.cpu.pop(unpinned)

    def _check_shapes(self, request: LoRARequest, weights: LoraWeights) -> None:
        shapes = self.dims.module_shapes()
        expert_shapes = experts.expert_shapes(self.dims)
        for layer, params in weights.experts.items():
            for name, (a, b) in params.items():
                k, n = expert_shapes[name]
                e, r = self.dims.num_experts, a.shape[-2]
                want = ((r, k), (n, r)) if name == experts.ROUTER else ((e, r, k), (e, n, r))
                if layer not in self.dims.moe_layers or (a.shape, b.shape) != want:
                    raise LoRAError(
                        f"adapter {request.lora_name!r}: mlp.experts.{name} of layer {layer} does "
                        f"not fit the base model ({e} experts, in {k}, out {n}, MoE layers "
                        f"{list(self.dims.moe_layers)})"
                    )
        for layer, modules in weights.layers.items():
            if layer >= self.dims.num_layers:
                raise LoRAError(
                    f"adapter {request.lora_name!r} has layer {layer}; the base model has "
                    f"{self.dims.num_layers}"
                )
            for name, (a, b) in modules.items():
                k, n = shapes[name]
                if a.shape[1] != k or b.shape[0] != n:
                    raise LoRAError(
                        f"adapter {request.lora_name!r}: {name} of layer {layer} is "
                        f"{tuple(b.shape[:1]) + tuple(a.shape[1:])} (out, in); the base model "
                        f"needs ({n}, {k})"
                    )
