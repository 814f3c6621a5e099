"""The per-step LoRA hook of :class:`~loramux.engine.lora.manager.LoRAManager` (the model's
``LoRAHook``): one batch layout per step, then every projection group of every layer adds
its adapters' deltas through ``lora.ops``. Runs on the engine thread."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from loramux.engine.lora import ops
from loramux.engine.lora.meta import LoRABatchMeta

if TYPE_CHECKING:
    from loramux.engine.lora.manager import LoRAManager


class StepHook:
    """Mixed into :class:`~loramux.engine.lora.manager.LoRAManager`."""

    def prepare_step(self: LoRAManager, token_lora_keys: list[str | None]) -> None:
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

    def finish_step(self: LoRAManager) -> None:
        """Release step-scoped state; run evictions that waited for the batch to drain."""
        self._step_keys = set()
        self._meta = None
        self._run_pending_evictions()

    def _run_pending_evictions(self: LoRAManager) -> None:
        if self.evict_pending:
            running = self.running_keys() | self._step_keys
            for key in list(self.evict_pending):
                if key not in running:
                    self._free_slot(key)
                    self.evict_pending.discard(key)

    def active(self: LoRAManager) -> bool:
        return self._meta is not None and self._meta.has_lora

    def add(self: LoRAManager, layer: int, group: str, x: torch.Tensor, y: torch.Tensor) -> None:
        """``y += `` this step's adapters' delta for ``x`` in projection ``group`` of ``layer``."""
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
