"""Adapter capacity: how many device slots and CPU-tier adapters the memory holds.

Like the KV cache, the number of adapters one step may use is a memory budget, not a
small constant. With ``max_loras`` set it keeps vLLM's meaning (at most that many adapters
in one step, one device slot each); left unset it is derived here:

* CPU: slots live in host memory beside the CPU tier, so each adapter costs one slot
  (padded to ``max_lora_rank``) plus its CPU-tier copy. ``lora_memory`` bytes (default
  :data:`~loramux.engine.config.DEFAULT_CPU_LORA_MEMORY`) hold
  ``lora_memory // (slot + copy)`` of them; every adapter of the CPU tier then has a slot.
* CUDA: the memory left after the weights (``gpu_memory_utilization``) is split: adapter
  slots take ``lora_memory`` bytes (default
  :data:`~loramux.engine.config.GPU_LORA_MEMORY_SHARE` of it) and are allocated before
  the KV cache, which gets the rest.

Both are capped by ``max_cpu_loras`` when that is set and by
:data:`~loramux.engine.config.MAX_DERIVED_LORAS`. A slot costs the largest rank's size
(the kernels read one stacked tensor per projection group), and on an MoE base every slot
holds LoRA for every expert (``experts.py``: experts × rank × (in + out) per expert parameter
and MoE layer, usually most of the slot); paging adapter weights by
their own rank in one pool with the KV blocks (S-LoRA) is not done.
"""

from __future__ import annotations

from dataclasses import dataclass

from loramux.adapters.arch import PROJECTION_GROUPS, SUPPORTED_MODULES, BaseModelDims
from loramux.engine.config import (
    DEFAULT_CPU_LORA_MEMORY,
    GPU_LORA_MEMORY_SHARE,
    MAX_DERIVED_LORAS,
    LoRAConfig,
)
from loramux.engine.lora.experts import expert_adapter_bytes, expert_slot_bytes

GPU_RESERVE_BYTES = 1 << 30
"""Device memory left free for activations and the allocator (as the KV cache plan does)."""


@dataclass(frozen=True)
class LoRACapacity:
    """The resolved adapter capacity of one engine."""

    num_slots: int
    """Device slots: the most distinct adapters in one step."""
    max_cpu_loras: int
    """Adapters kept in the CPU tier (LRU)."""
    slot_bytes: int
    """Bytes of one device slot (every projection group, padded to max_lora_rank)."""
    budget_bytes: int | None = None
    """The memory the slots were derived from; None when ``max_loras`` was given."""
    adapter_allowance: int | None = None
    """Derived on the CPU: the bytes the plan counts for one adapter's own weights (its
    CPU-tier copy at ``max_lora_rank`` on every projection); an adapter with vocabulary parts
    (``vocab.py``) must fit its copy and those parts' slot tensors in it (None: not checked)."""
    vocab_pool: int | None = None
    """Derived on a GPU: what the adapter memory holds beyond its slots, which the vocabulary
    parts of all resident adapters share (they are allocated after the KV cache took the rest;
    None: not checked)."""

    @property
    def derived(self) -> bool:
        return self.budget_bytes is not None


def slot_bytes(
    dims: BaseModelDims, max_rank: int, element_size: int, *, blockdiag: bool, scale_element_size: int = 4,
) -> int:
    """Bytes one slot of :class:`~loramux.engine.lora.slots.SlotBuffers` takes: per layer and
    projection group, A ``[slices, R, K]`` and B ``[N_total, R]`` (``blockdiag``:
    ``[slices * R, N_total]``), and DoRA's per-row scale ``[N_total]`` (``scale_element_size``:
    bytes per value of the activations' dtype, which it is kept in)."""
    shapes = dims.module_shapes()
    per_layer = 0
    for modules in PROJECTION_GROUPS.values():
        k = shapes[modules[0]][0]
        n_total = sum(shapes[m][1] for m in modules)
        per_layer += len(modules) * max_rank * k
        per_layer += (len(modules) * max_rank if blockdiag else max_rank) * n_total
    row_gain = sum(sum(shapes[m][1] for m in modules) for modules in PROJECTION_GROUPS.values())
    return (dims.num_layers * (per_layer * element_size + row_gain * scale_element_size)
            + expert_slot_bytes(dims, max_rank, element_size))


def adapter_bytes(
    dims: BaseModelDims, rank: int, element_size: int, modules: tuple[str, ...] | None = None
) -> int:
    """Bytes of an adapter's weights at its own rank (its CPU-tier copy): ``r * (in + out)``
    per targeted projection and layer; ``modules`` None = all seven and, on an MoE base, LoRA on
    every expert too (``experts × r × (in + out)`` per expert parameter and MoE layer)."""
    shapes = dims.module_shapes()
    names = modules if modules is not None else SUPPORTED_MODULES
    experts = expert_adapter_bytes(dims, rank, element_size) if modules is None else 0
    return dims.num_layers * sum(rank * (shapes[m][0] + shapes[m][1]) for m in names) * element_size + experts


def plan_capacity(
    config: LoRAConfig,
    dims: BaseModelDims,
    element_size: int,
    *,
    device_type: str,
    blockdiag: bool,
    device_free_bytes: int | None = None,
    cpu_element_size: int | None = None,
    scale_element_size: int = 4,
) -> LoRACapacity:
    """Resolve ``max_loras`` / ``max_cpu_loras`` for this model and device.

    ``device_free_bytes`` (CUDA): the memory the engine may still use after the weights
    (``total * gpu_memory_utilization - used - reserve``); required when ``device_type`` is
    ``cuda`` and ``max_loras`` is unset. ``cpu_element_size``: bytes per value of the CPU-tier
    copies (None = ``element_size``, the slots'); ``scale_element_size``: the activations'
    (DoRA's per-row scales)."""
    per_slot = slot_bytes(dims, config.max_lora_rank, element_size, blockdiag=blockdiag,
                          scale_element_size=scale_element_size)
    if config.max_loras is not None:
        cpu = config.max_cpu_loras if config.max_cpu_loras is not None else 2 * config.max_loras
        return LoRACapacity(config.max_loras, cpu, per_slot)
    cap = MAX_DERIVED_LORAS if config.max_cpu_loras is None else config.max_cpu_loras
    if device_type == "cuda":
        if device_free_bytes is None:
            raise ValueError("deriving max_loras on a GPU needs the free device memory")
        budget = config.lora_memory
        if budget is None:
            budget = int(max(device_free_bytes, 0) * GPU_LORA_MEMORY_SHARE)
        per_adapter = per_slot
    else:
        budget = config.lora_memory if config.lora_memory is not None else DEFAULT_CPU_LORA_MEMORY
        cpu_size = cpu_element_size if cpu_element_size is not None else element_size
        per_adapter = per_slot + adapter_bytes(dims, config.max_lora_rank, cpu_size)
    slots = min(budget // per_adapter, cap)
    if slots < 1:
        raise ValueError(
            f"adapter memory of {budget} bytes holds no adapter slot ({per_adapter} bytes each at "
            f"max_lora_rank={config.max_lora_rank}); give lora_memory more bytes, lower "
            f"max_lora_rank or set max_loras"
        )
    if config.max_cpu_loras is not None:
        cpu = config.max_cpu_loras
    else:
        cpu = slots if device_type != "cuda" else min(2 * slots, MAX_DERIVED_LORAS)
    allowance = per_adapter - per_slot if device_type != "cuda" else None
    pool = int(budget - slots * per_slot) if device_type == "cuda" else None
    return LoRACapacity(int(slots), int(cpu), per_slot, int(budget), allowance, pool)
