"""What an operator does to adapters (the admin API: evict, pin, warm) and what the
admin pages show (the residency snapshot), as a part of :class:`LoRAManager`."""

from __future__ import annotations

from typing import TYPE_CHECKING

from loramux.engine.errors import LoRAError
from loramux.engine.lora.state import AdapterState, ResidencySnapshot

if TYPE_CHECKING:
    from loramux.engine.lora.manager import LoRAManager


class OperatorActions:
    """Mixed into :class:`~loramux.engine.lora.manager.LoRAManager`; runs on the engine
    thread."""

    # --- operator actions (admin API) --------------------------------------------------
    def evict(self: LoRAManager, key: str) -> bool:
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

    def pin(self: LoRAManager, key: str) -> None:
        """Keep the adapter resident (never evicted); loads it if needed."""
        self._state(key).pinned = True
        self.warm(key)

    def unpin(self: LoRAManager, key: str) -> None:
        self._state(key).pinned = False

    def warm(self: LoRAManager, key: str) -> bool:
        """Start loading the adapter into CPU memory (in the background: the engine loop
        never waits on the disk) and, once it is there, place it in a free or evictable
        device slot. Returns True once it sits in a device slot; call again until then."""
        state = self._state(key)
        if key in self.slot_of:
            return True
        self.poll()
        if state.error is not None:
            raise state.error
        return self.acquire(key, set())

    def _state(self: LoRAManager, key: str) -> AdapterState:
        state = self.adapters.get(key)
        if state is None:
            raise LoRAError(f"adapter {key!r} is not known to this engine")
        return state

    def snapshot(self: LoRAManager) -> ResidencySnapshot:
        """The residency as plain data (call on the engine thread)."""
        return ResidencySnapshot(
            self.residency(), self.max_loras, self.num_evictions, True, self.max_cpu_loras,
            self.load_stats.as_dict(),
        )

    def residency(self: LoRAManager) -> list[dict]:
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
                    "slot_seconds": state.slot_seconds,
                    "error": str(state.error) if state.error else None,
                }
            )
        return rows
