"""LoRA on the experts of an MoE base: the slot buffers and the per-step batched delta.

Slots (:class:`ExpertSlots`, beside :class:`~loramux.engine.lora.slots.SlotBuffers`' and with
the same slot indices): per MoE layer and expert parameter (``gate_up_proj``, ``down_proj``)
``a`` [max_loras, E, R, K] holding each expert's A times its scale and ``b`` [max_loras, E, R, N]
each expert's B transposed (R = ``max_lora_rank``; rows past an adapter's rank are zero). An
adapter without expert LoRA leaves its slot's part untouched and unread.

Per step (:class:`ExpertStep`): the slots of the step that carry expert LoRA, each token's
index among them. An MoE block calls :meth:`ExpertStep.add` on its expert-sorted rows. With
the torch backend (the CPU) the expert slots are read as the block-diagonal slot layout of
``max_loras * E`` virtual slots (``slot * E + expert``, A ``[.., 1, R, K]``, B ``[.., R, N]``)
and the rows go through the engine's own LoRA kernel (the CPU SGMV kernel: one call per
projection over all (token, adapter, expert) runs; the layout is built once per layer and
shared by its gate_up and down calls). Otherwise (the Triton backend's layout): for every
expert with rows, one shrink over the active slots' A of that expert
(``[c, K] @ [K, S R]``), a mask keeping each row's own adapter's R columns, and one expand
(``[c, S R] @ [S R, N]``) added to the rows — one matmul pair per (expert, projection),
batched over adapters as the torch backend's block-diagonal path is; its extra FLOPs are a
fraction ``S R / K`` of the expert's own projection. A step with few rows (decode, up to
:data:`GATHER_ROWS`) gathers each row's own A and B instead and runs two batched matmuls
over the rows (memory bounded by the row limit).
"""

from __future__ import annotations

import numpy as np
import torch

from loramux.adapters.experts import EXPERT_PARAMS, expert_shapes
from loramux.adapters.format import LoraWeights
from loramux.engine.lora.meta import LoRABatchMeta

GROUP_PARAM = {"gate_up": "gate_up_proj", "down": "down_proj"}
GATHER_ROWS = 64
"""Up to this many (token, expert) rows (decode steps) each row's A and B are gathered and
applied in two batched matmuls; above it, the per-expert matmul pair over all active slots."""
"""An MoE block's projection group → the expert parameter its LoRA targets."""


def expert_slot_bytes(dims, max_rank: int, element_size: int) -> int:
    """Bytes of one slot's expert part (0 for a dense base)."""
    if not dims.num_experts:
        return 0
    per_layer = sum(k + n for k, n in expert_shapes(dims).values()) * dims.num_experts * max_rank
    return len(dims.moe_layers) * per_layer * element_size


def expert_adapter_bytes(dims, rank: int, element_size: int) -> int:
    """Bytes of an adapter's expert LoRA at ``rank`` on both parameters (its CPU-tier copy)."""
    return expert_slot_bytes(dims, rank, element_size)


class ExpertSlots:
    """The experts' LoRA of every slot (see the module docstring)."""

    def __init__(self, dims, max_loras: int, max_rank: int, dtype: torch.dtype, device) -> None:
        self.dims = dims
        self.max_rank = max_rank
        shapes = expert_shapes(dims)
        e = dims.num_experts
        # CPU: untouched pages cost nothing until a slot with expert LoRA is written
        alloc = torch.empty if torch.device(device).type == "cpu" else torch.zeros
        self.a = {layer: {p: alloc(max_loras, e, max_rank, shapes[p][0], dtype=dtype, device=device)
                          for p in EXPERT_PARAMS} for layer in dims.moe_layers}
        self.b = {layer: {p: alloc(max_loras, e, max_rank, shapes[p][1], dtype=dtype, device=device)
                          for p in EXPERT_PARAMS} for layer in dims.moe_layers}
        self.has = np.zeros(max_loras, dtype=bool)
        """Slots whose adapter has expert LoRA (only those are read)."""
        self.ranks = torch.zeros(max_loras, dtype=torch.int64)
        """The largest expert-LoRA rank of each slot (0: none)."""

    def write(self, slot: int, weights: LoraWeights) -> None:
        """Copy the adapter's expert LoRA into ``slot`` (called by ``SlotBuffers._write``)."""
        self.has[slot] = bool(weights.experts)
        self.ranks[slot] = max((a.shape[1] for params in weights.experts.values()
                                for a, _ in params.values()), default=0)
        if not weights.experts:
            return
        spec = weights.spec
        for layer in self.dims.moe_layers:
            for p in EXPERT_PARAMS:
                a, b = self.a[layer][p][slot], self.b[layer][p][slot]
                a.zero_()
                b.zero_()
                pair = weights.experts.get(layer, {}).get(p)
                if pair is None:
                    continue
                wa, wb = pair  # [E, r, K], [E, N, r]
                r = wa.shape[1]
                if r > self.max_rank:
                    raise ValueError(f"expert LoRA rank {r} exceeds max_lora_rank {self.max_rank}")
                a[:, :r].copy_(wa.to(a.dtype) * spec.expert_scale(p), non_blocking=True)
                b[:, :r].copy_(wb.transpose(1, 2), non_blocking=True)

    def clear(self, slot: int) -> None:
        self.has[slot] = False
        self.ranks[slot] = 0

    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for d in (self.a, self.b) for g in d.values()
                   for t in g.values())


class ExpertStep:
    """One step's expert-LoRA layout: the model's :class:`~loramux.engine.model.moe.ExpertLoRAHook`
    through ``LoRAStepBatch``."""

    def __init__(self, slots: ExpertSlots, device, kernel=None) -> None:
        """``kernel``: the engine's LoRA kernel when its slots are the torch backend's
        block-diagonal layout (``ops.lora_kernel``), which the experts' slots share: each
        (slot, expert) is then one virtual slot of the CPU SGMV kernel."""
        self.slots = slots
        self.device = device
        self._kernel = kernel
        self._active: torch.Tensor | None = None  # [S] slots with expert LoRA in this step
        self._active_np: np.ndarray | None = None
        self._token_local: torch.Tensor | None = None  # [T] index into _active, -1: none
        self._virtual_ranks: torch.Tensor | None = None  # [max_loras * E] rank of (slot, expert)
        self._layer_meta: tuple[int, LoRABatchMeta] | None = None  # the layer's rows' layout

    def prepare(self, token_slots: np.ndarray) -> None:
        """Lay out a step whose token t uses slot ``token_slots[t]`` (-1: none)."""
        used = np.unique(token_slots[token_slots >= 0])
        active = used[self.slots.has[used]] if used.size else used
        if not active.size:
            self.clear()
            return
        local = np.full(self.slots.has.shape[0], -1, dtype=np.int64)
        local[active] = np.arange(active.size)
        self._active_np = active.astype(np.int64)
        self._active = torch.from_numpy(self._active_np).to(self.device)
        self._virtual_ranks = self.slots.ranks.repeat_interleave(self.slots.dims.num_experts)
        self._layer_meta = None
        self._token_local = torch.from_numpy(np.where(token_slots >= 0, local[np.maximum(token_slots, 0)],
                                                      -1)).to(self.device)

    def clear(self) -> None:
        self._active = None
        self._token_local = None
        self._layer_meta = None

    def active(self, layer: int) -> bool:
        return self._active is not None and layer in self.slots.a

    def add(self, layer: int, group: str, x: torch.Tensor, y: torch.Tensor,
            tokens: torch.Tensor, counts: list[int]) -> None:
        """``y[j] +=`` row j's expert delta (rows sorted by expert, ``counts[e]`` each; row j is
        token ``tokens[j]``)."""
        p = GROUP_PARAM[group]
        a_all, b_all = self.slots.a[layer][p], self.slots.b[layer][p]  # [L, E, R, K], [L, E, R, N]
        active = self._active
        s, r = active.numel(), self.slots.max_rank
        row_local = self._token_local.index_select(0, tokens)  # [M]
        if self._kernel is not None:
            meta = self._meta(layer, row_local, counts)
            n_slots, e, r_max, k = a_all.shape
            self._kernel(y, x, a_all.view(n_slots * e, 1, r_max, k), b_all.view(n_slots * e, r_max, -1),
                         meta, None, [0, y.shape[1]])
            return
        if x.shape[0] <= GATHER_ROWS:
            self._add_gathered(a_all, b_all, x, y, row_local, counts)
            return
        mask = (row_local.unsqueeze(1) == torch.arange(s, device=x.device)).to(a_all.dtype)  # [M, S]
        start = 0
        for e, c in enumerate(counts):
            if not c:
                continue
            rows = slice(start, start + c)
            start += c
            a = a_all[active, e].reshape(s * r, -1)  # [S R, K]
            b = b_all[active, e].reshape(s * r, -1)  # [S R, N]
            h = x[rows].to(a.dtype) @ a.T  # [c, S R]
            h = (h.view(c, s, r) * mask[rows].unsqueeze(2)).view(c, s * r)
            y[rows] += (h @ b).to(y.dtype)

    def _add_gathered(self, a_all, b_all, x, y, row_local, counts) -> None:
        """Few rows (decode): each adapter row's own expert A and B gathered, two batched
        matmuls over the rows (no per-expert loop)."""
        idx = (row_local >= 0).nonzero().squeeze(1)  # [m] rows with an expert adapter
        if not idx.numel():
            return
        experts = torch.repeat_interleave(torch.arange(len(counts), device=x.device),
                                          torch.tensor(counts, device=x.device))  # [M]
        slots = self._active.index_select(0, row_local.index_select(0, idx))
        rows = experts.index_select(0, idx)
        a = a_all[slots, rows]  # [m, R, K]
        b = b_all[slots, rows]  # [m, R, N]
        h = torch.bmm(a, x.index_select(0, idx).to(a.dtype).unsqueeze(2))  # [m, R, 1]
        y.index_add_(0, idx, torch.bmm(h.transpose(1, 2), b).squeeze(1).to(y.dtype))

    def _meta(self, layer: int, row_local: torch.Tensor, counts: list[int]) -> LoRABatchMeta:
        """The rows' layout over virtual slots ``slot * E + expert`` (-1: no expert adapter),
        built at a layer's gate_up call and reused by its down call (the same rows)."""
        if self._layer_meta is not None and self._layer_meta[0] == layer:
            return self._layer_meta[1]
        e = self.slots.dims.num_experts
        experts = np.repeat(np.arange(len(counts), dtype=np.int64), counts)  # [M]
        local = row_local.cpu().numpy()
        virtual = np.where(local >= 0, self._active_np[np.maximum(local, 0)] * e + experts, -1)
        meta = LoRABatchMeta.build(virtual, self._virtual_ranks, self.device)
        self._layer_meta = (layer, meta)
        return meta
