"""The adapters' own norms (PEFT ``modules_to_save`` copies, ``adapters/saved_modules.py``) in
the slots, and their step.

Per slot (:class:`NormSlots`, beside the vocabulary parts; written with the adapter, freed with
its slot, counted in the slots' bytes) the norms whose copy differs from the base's, by
``(layer, checkpoint name)`` (layer None: the final norm). :class:`NormStep` recomputes a norm's
output for the rows of each slot that has its own, from the same input and with the same
function as the base rows (so an equal copy would give the same bits): base rows and other
adapters' rows are untouched.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from loramux.adapters.saved_modules import norm_role
from loramux.adapters.weights import LoraWeights

__all__ = ["NormKey", "NormSlots", "NormStep"]

NormKey = tuple[int | None, str]
"""``(layer, checkpoint name)``: ``(3, "input_layernorm")``, ``(None, "norm")``."""


class NormSlots:
    """Each slot's own norms on the device (none for a slot whose adapter has none)."""

    def __init__(self, dtype: torch.dtype, device) -> None:
        self.dtype = dtype
        self.device = device
        self.base: dict[NormKey, torch.Tensor] = {}
        """The served model's norms by key (``DecoderModel.norm_weights``): what an adapter's
        copy may replace, and what an equal copy is dropped against."""
        self.by_slot: dict[int, dict[NormKey, torch.Tensor]] = {}

    def entries(self, weights: LoraWeights) -> dict[NormKey, torch.Tensor]:
        """``weights``' norms that differ from the base's, by key, in the base's dtype; raises
        ``ValueError`` for a norm the served model has not or of another shape."""
        out = {}
        for path, w in weights.norms.items():
            key = norm_role(path)
            base = self.base.get(key)
            if base is None:
                raise ValueError(f"modules_to_save copy {path!r}: the served model has no such norm")
            if tuple(w.shape) != tuple(base.shape):
                raise ValueError(f"modules_to_save copy {path!r} of shape {list(w.shape)}; the served "
                                 f"model's is {list(base.shape)}")
            w = w.to(base.dtype)
            if not torch.equal(w.to(base.device), base):
                out[key] = w
        return out

    def write(self, slot: int, weights: LoraWeights) -> None:
        """Put ``weights``' own norms in ``slot`` (clearing what was there)."""
        entries = self.entries(weights)
        self.clear(slot)
        if entries:
            self.by_slot[slot] = {k: w.to(self.device, non_blocking=True) for k, w in entries.items()}

    def clear(self, slot: int) -> None:
        """Free ``slot``'s norms."""
        self.by_slot.pop(slot, None)

    def has(self, slot: int) -> bool:
        """True when ``slot``'s adapter has a norm of its own."""
        return slot in self.by_slot

    def num_bytes(self) -> int:
        """Bytes the slots' norms hold on the device."""
        return sum(t.numel() * t.element_size() for entry in self.by_slot.values() for t in entry.values())


NormFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""``fn(x, weight)``: the norm the base rows went through, for rows ``x`` and ``weight``."""


class NormStep:
    """One step's slots with norms of their own, and the slot of each of its tokens."""

    def __init__(self, slots: NormSlots, token_slots: torch.Tensor, step_slots: list[int]) -> None:
        self.slots = slots
        self.token_slots = token_slots
        self.step_slots = step_slots

    def apply(self, key: NormKey, fn: NormFn, source: torch.Tensor, out: torch.Tensor,
              rows: torch.Tensor | None = None) -> None:
        """``out[i] = fn(source[i], w)`` for the rows ``i`` of each slot with its own norm ``key``
        (``w``); ``rows``: the batch tokens of ``source``'s rows (None: all, in order)."""
        token_slots = None
        for slot in self.step_slots:
            w = self.slots.by_slot[slot].get(key)
            if w is None:
                continue
            if token_slots is None:
                token_slots = self.token_slots if rows is None else self.token_slots.index_select(0, rows)
            idx = (token_slots == slot).nonzero().squeeze(1)
            if idx.numel():
                out.index_copy_(0, idx, fn(source.index_select(0, idx), w).to(out.dtype))
