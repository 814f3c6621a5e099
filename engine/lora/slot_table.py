"""The device slot table: which adapter sits in which slot of the :class:`SlotBuffers`.

It keeps the residency order (least recently used first), the pinned adapters (never
evicted), the reservations of slots being written in the background (no step reads them,
nothing else takes them, until the write is applied or, for a dropped adapter, done), and
the evictions deferred until an adapter's rows have left the running batch. Busy adapters
(running requests and the step in flight) come from the ``busy`` callable; an adapter in
use is never evicted. Runs on the engine thread.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from types import MappingProxyType

from loramux.engine.lora.slots import SlotBuffers


class SlotTable:
    """Slots, residency (LRU), pins, reservations and deferred evictions."""

    def __init__(
        self,
        buffers: SlotBuffers,
        busy: Callable[[], set[str]],
        on_evicted: Callable[[str], None],
    ) -> None:
        """``busy()``: the adapters in use now; ``on_evicted(key)``: called when an adapter
        leaves its slot."""
        self.buffers = buffers
        self.num_slots = buffers.max_loras
        self._busy = busy
        self._on_evicted = on_evicted
        self._slot_of: dict[str, int] = {}
        self._lru: OrderedDict[str, None] = OrderedDict()  # residency, oldest first
        self._reserved: dict[str, int] = {}  # slots being written for an adapter
        self._orphans: list[tuple[Future, int]] = []  # writes of dropped adapters, still running
        self.pinned: set[str] = set()
        self.pending: set[str] = set()
        """Adapters to evict once no running request uses them."""
        self.num_evictions = 0
        self.slot_of: Mapping[str, int] = MappingProxyType(self._slot_of)
        """Adapter -> slot of every resident adapter (read-only view)."""

    # --- residency ---------------------------------------------------------------------
    def is_resident(self, key: str) -> bool:
        return key in self._slot_of

    def touch(self, key: str) -> None:
        """``key`` was used: it is the most recently used now."""
        self._lru.move_to_end(key)

    def place(self, key: str, slot: int) -> None:
        """``key``'s weights now sit in ``slot`` (written by the caller)."""
        self._slot_of[key] = slot
        self._lru[key] = None

    def empty_slot(self) -> int | None:
        """A slot nobody holds, reserves or is still writing, or None."""
        used = set(self._slot_of.values()) | set(self._reserved.values())
        used |= {slot for _, slot in self._orphans}
        return next((s for s in range(self.num_slots) if s not in used), None)

    def claim(self, protected: set[str]) -> int | None:
        """An empty slot, or the slot of the least recently used adapter that is neither in
        ``protected``, busy nor pinned (evicted now); None when every slot is held."""
        slot = self.empty_slot()
        if slot is not None:
            return slot
        busy = protected | self._busy()
        for key in self._lru:  # least recently used first
            if key in busy or key in self.pinned:
                continue
            slot = self._slot_of[key]
            self.free(key)
            return slot
        return None

    # --- eviction ------------------------------------------------------------------------
    def evict(self, key: str) -> bool:
        """Free ``key``'s slot now, or once no running request uses it; False when it has
        no slot."""
        if key not in self._slot_of:
            return False
        if key in self._busy():
            self.pending.add(key)
        else:
            self.free(key)
        return True

    def free(self, key: str) -> None:
        """Free ``key``'s slot now (nothing when it has none)."""
        slot = self._slot_of.pop(key, None)
        self._lru.pop(key, None)
        if slot is not None:
            self.buffers.clear(slot)
            self.num_evictions += 1
            self._on_evicted(key)

    def run_pending(self) -> None:
        """Run the deferred evictions whose adapter is idle now and release the slots of
        finished orphaned writes (between steps)."""
        if self.pending:
            busy = self._busy()
            for key in [k for k in self.pending if k not in busy]:
                self.free(key)
                self.pending.discard(key)
        for fut, slot in [o for o in self._orphans if o[0].done()]:
            self._orphans.remove((fut, slot))
            self.buffers.clear(slot)

    # --- pins ------------------------------------------------------------------------------
    def pin(self, key: str) -> None:
        self.pinned.add(key)

    def unpin(self, key: str) -> None:
        self.pinned.discard(key)

    # --- reservations ------------------------------------------------------------------------
    def reserve(self, key: str, slot: int) -> None:
        """Hold ``slot`` for ``key`` while its weights are written in the background."""
        self._reserved[key] = slot

    def unreserve(self, key: str) -> int | None:
        """The slot reserved for ``key`` (None: none), no longer reserved."""
        return self._reserved.pop(key, None)

    def orphan(self, key: str, write: Future) -> None:
        """``key`` was dropped while ``write`` ran: its reserved slot stays held until the
        write is done, then it is cleared (:meth:`run_pending`)."""
        slot = self._reserved.pop(key, None)
        if slot is not None:
            self._orphans.append((write, slot))
