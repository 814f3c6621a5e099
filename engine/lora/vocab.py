"""The vocabulary parts of the adapters in the slots (``adapters/vocab.py``), and their step.

Per slot (:class:`VocabSlots`, beside the A/B stacks of ``slots.py``, made when an adapter with
such parts is written, freed when its slot is cleared, counted in the slots' bytes):

* ``embed``: what changes a token's embedding row, applied per token of the slot before the
  family's embedding scale (as PEFT's wrappers do): an ``embed_tokens`` LoRA
  ``E[t] + s · A.T[t] @ B.T`` and trainable tokens, whose rows replace ``E[t]`` for their ids;
* ``head``: what changes a logits row, on the final normalized hidden state ``h`` before any
  soft-cap: an ``lm_head`` LoRA ``+ s · (h @ A.T) @ B.T``, and trainable tokens' columns
  ``h @ rows.T`` (the ``lm_head`` ones, or the ``embed_tokens`` ones where the base ties its
  embeddings: PEFT ties the wrapper).

:class:`VocabStep` applies them in a mixed batch: each slot's own tokens and logits rows, by the
step's token slots (rows of the base model and of other adapters are untouched).
"""

from __future__ import annotations

import torch

from loramux.adapters.full_copies import ties_head
from loramux.adapters.weights import LoraWeights

__all__ = ["VocabSlots", "VocabStep"]


class VocabSlots:
    """Each slot's vocabulary parts on the device (none for a slot whose adapter has none)."""

    def __init__(self, dtype: torch.dtype, device, tied: bool, vocab_size: int, hidden_size: int) -> None:
        """``tied``: the base model ties ``lm_head`` to its embedding."""
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.dtype = dtype
        self.device = device
        self.tied = tied
        self.embed_lora: dict[int, tuple[torch.Tensor, torch.Tensor, float]] = {}
        """slot -> (A.T [vocab, r], B.T [r, hidden], scale)."""
        self.head_lora: dict[int, tuple[torch.Tensor, torch.Tensor, float]] = {}
        """slot -> (A [r, hidden], B [vocab, r], scale)."""
        self.embed_tokens: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        """slot -> (sorted ids [n] int64, their rows [n, hidden])."""
        self.head_tokens: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        """slot -> (ids [n] int64, their rows [n, hidden]): the logits columns they replace."""
        self.allowance: int | None = None
        """Bytes one adapter may take (its CPU-tier copy + these slot tensors) where the capacity
        was derived from memory (``capacity.LoRACapacity.adapter_allowance``); None: unchecked."""
        self.pool: int | None = None
        """Bytes all slots' parts may take together where a GPU's capacity was derived from
        memory (``capacity.LoRACapacity.vocab_pool``); None: unchecked."""

    def _put(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(device=self.device, dtype=self.dtype, non_blocking=True).contiguous()

    def write(self, slot: int, weights: LoraWeights) -> None:
        """Put ``weights``' vocabulary parts in ``slot`` (clearing what was there); raises
        ``ValueError`` for parts that do not fit the served model (an adapter never validated
        against it: its load fails, nothing is written)."""
        self.check(weights, slot)
        self.clear(slot)
        scale = weights.spec.scale
        for module, (a, b) in weights.vocab_lora.items():
            if module == "embed_tokens":
                self.embed_lora[slot] = (self._put(a.t()), self._put(b.t()), scale)
            else:
                self.head_lora[slot] = (self._put(a), self._put(b), scale)
        tokens = self.replacement_rows(weights)
        if "embed_tokens" in tokens:
            ids, rows = tokens["embed_tokens"]
            order = torch.argsort(ids)
            self.embed_tokens[slot] = (ids[order].to(self.device), self._put(rows[order]))
        if "lm_head" in tokens:
            ids, rows = tokens["lm_head"]
            self.head_tokens[slot] = (ids.to(self.device), self._put(rows))

    def replacement_rows(self, weights: LoraWeights) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """The rows ``weights`` replaces per module: its trainable tokens (a tied base's embedding
        ones reach the logits too: PEFT ties the wrapper) and the rows of its full copies that
        differ from the base (a ``base_layer`` copy of a tied base's embedding too:
        ``adapters/full_copies.py``). Raises ``ValueError`` where the two meet on one module."""
        tokens = dict(weights.vocab_tokens)
        if self.tied and "embed_tokens" in tokens and "lm_head" not in tokens:
            tokens["lm_head"] = tokens["embed_tokens"]
        rows = dict(weights.vocab_rows)
        if self.tied and "embed_tokens" in rows and "lm_head" not in rows and ties_head(weights.full_copies):
            rows["lm_head"] = rows["embed_tokens"]
        both = sorted(set(tokens) & set(rows))
        if both:
            raise ValueError(f"{both[0]}: trainable tokens and a full copy's rows on one module")
        return {**tokens, **rows}

    def check(self, weights: LoraWeights, slot: int | None = None) -> None:
        """Raise ``ValueError`` when ``weights``' vocabulary parts do not fit the served model or
        the memory (written into ``slot``, whose present parts it replaces)."""
        v, h = self.vocab_size, self.hidden_size
        if self.allowance is not None and (weights.vocab_lora or weights.vocab_tokens or weights.vocab_rows):
            need = weights.num_bytes() + self.part_bytes(weights)
            if need > self.allowance:
                raise ValueError(
                    f"the adapter with its embedding / lm_head parts takes {need} bytes, above the "
                    f"{self.allowance} bytes the adapter memory plan counts for one adapter "
                    f"(max_lora_rank on every projection); raise lora_memory or max_lora_rank, or set max_loras")
        if self.pool is not None and (weights.vocab_lora or weights.vocab_tokens or weights.vocab_rows):
            need = self.num_bytes() - self.num_bytes(slot) + self.part_bytes(weights)
            if need > self.pool:
                raise ValueError(
                    f"the resident adapters' embedding / lm_head parts would take {need} bytes, above "
                    f"the {self.pool} bytes the adapter memory holds beyond its slots; raise lora_memory "
                    f"or set max_loras")
        for module, (a, b) in weights.vocab_lora.items():
            want = ((a.shape[0], v), (h, a.shape[0])) if module == "embed_tokens" else ((a.shape[0], h), (v, a.shape[0]))
            if (tuple(a.shape), tuple(b.shape)) != want:
                raise ValueError(f"{module} LoRA of shapes {list(a.shape)}, {list(b.shape)} does not fit the "
                                 f"served model (vocabulary {v}, hidden size {h})")
        for module, (ids, rows) in self.replacement_rows(weights).items():
            if ids.numel() and (int(ids.max()) >= v or int(ids.min()) < 0):
                raise ValueError(f"{module} trainable token id {int(ids.max())} is outside the served "
                                 f"model's vocabulary of {v}")
            if tuple(rows.shape) != (ids.numel(), h):
                raise ValueError(f"{module} trainable tokens of shape {list(rows.shape)}; expected "
                                 f"[{ids.numel()}, {h}]")

    def part_bytes(self, weights: LoraWeights) -> int:
        """Bytes ``weights``' vocabulary parts take in a slot (in the slots' dtype; a tied
        base's trainable tokens twice: the embedding's and the logits')."""
        size = torch.finfo(self.dtype).bits // 8
        n = sum(a.numel() + b.numel() for a, b in weights.vocab_lora.values()) * size
        tokens = self.replacement_rows(weights)
        return n + sum(rows.numel() * size + ids.numel() * 8 for ids, rows in tokens.values())

    def clear(self, slot: int) -> None:
        """Free ``slot``'s parts."""
        for part in (self.embed_lora, self.head_lora, self.embed_tokens, self.head_tokens):
            part.pop(slot, None)

    def has(self, slot: int) -> bool:
        """True when ``slot``'s adapter has some vocabulary part."""
        return any(slot in p for p in (self.embed_lora, self.head_lora, self.embed_tokens, self.head_tokens))

    def num_bytes(self, slot: int | None = None) -> int:
        """Bytes the parts hold on the device (only ``slot``'s when given)."""
        return sum(t.numel() * t.element_size()
                   for part in (self.embed_lora, self.head_lora, self.embed_tokens, self.head_tokens)
                   for s, entry in part.items() if slot is None or s == slot
                   for t in entry if isinstance(t, torch.Tensor))


class VocabStep:
    """One step's vocabulary parts: the slots of the step that have some, and their tokens."""

    def __init__(self, slots: VocabSlots, token_slots: torch.Tensor, step_slots: list[int]) -> None:
        """``token_slots``: the step's slot per token (-1: none), on the device;
        ``step_slots``: the step's slots that have vocabulary parts."""
        self.slots = slots
        self.token_slots = token_slots
        self.step_slots = step_slots

    def embed(self, input_ids: torch.Tensor, residual: torch.Tensor) -> None:
        """``residual`` [T, hidden], the embedding rows of ``input_ids``: apply each slot's
        embedding LoRA and trainable tokens to its own tokens, in place."""
        v = self.slots
        for slot in self.step_slots:
            lora, tokens = v.embed_lora.get(slot), v.embed_tokens.get(slot)
            if lora is None and tokens is None:
                continue
            idx = (self.token_slots == slot).nonzero().squeeze(1)
            ids = input_ids.index_select(0, idx)
            if tokens is not None:  # replaced rows first: a LoRA adds to the adapter's own row
                tids, rows = tokens
                pos = torch.searchsorted(tids, ids).clamp_(max=tids.shape[0] - 1)
                hit = tids.index_select(0, pos) == ids
                residual.index_copy_(0, idx[hit], rows.index_select(0, pos[hit]).to(residual.dtype))
            if lora is not None:
                a_t, b_t, scale = lora
                delta = (a_t.index_select(0, ids) @ b_t) * scale
                residual.index_add_(0, idx, delta.to(residual.dtype))

    def head(self, hidden: torch.Tensor, logits: torch.Tensor, logits_rows: torch.Tensor) -> None:
        """``logits`` [B, vocab] fp32 of the normalized ``hidden`` [B, hidden] of the batch
        tokens ``logits_rows``: apply each slot's ``lm_head`` LoRA and trainable-token columns to
        its own rows, in place."""
        v = self.slots
        row_slots = None
        for slot in self.step_slots:
            lora, tokens = v.head_lora.get(slot), v.head_tokens.get(slot)
            if lora is None and tokens is None:
                continue
            if row_slots is None:
                row_slots = self.token_slots.index_select(0, logits_rows)
            rows = (row_slots == slot).nonzero().squeeze(1)
            if rows.numel() == 0:
                continue
            h = hidden.index_select(0, rows).to(v.dtype)
            if tokens is not None:  # replaced columns first: a LoRA adds to the adapter's own
                tids, trows = tokens
                sub = logits.index_select(0, rows)
                sub[:, tids] = (h @ trows.t()).float()
                logits.index_copy_(0, rows, sub)
            if lora is not None:
                a, b, scale = lora
                logits.index_add_(0, rows, ((h @ a.t()) @ b.t() * scale).float())
