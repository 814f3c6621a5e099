"""LoRA on the experts of an MoE base: the slot buffers and the per-step batched delta.

Slots (:class:`ExpertSlots`, beside :class:`~loramux.engine.lora.slots.SlotBuffers`' and with
the same slot indices): per MoE layer and expert parameter (``gate_up_proj``, ``down_proj``)
``a`` [max_loras, E, R, K] holding each expert's A times its scale and ``b`` each expert's B,
as ``[max_loras, E, R, N]`` (B transposed: the torch backend's block-diagonal layout) or
``[max_loras, E, N, R]`` (the Triton kernels'); R = ``max_lora_rank``, rows past an adapter's
rank are zero; plus the router's LoRA (``router_a`` [max_loras, R, H] pre-scaled, ``router_b``
[max_loras, R, E]). An adapter without expert LoRA leaves its slot's part untouched and unread.

Per step (:class:`ExpertStep`): which tokens' slots carry expert LoRA. An MoE block calls
:meth:`ExpertStep.add` on its expert-sorted rows: each (slot, expert) is one virtual slot
``slot * E + expert`` of the slot layout (A ``[max_loras * E, 1, R, K]``), and the rows run
through the engine's own LoRA kernel — on the CPU the SGMV kernel, on CUDA the Triton
shrink/expand — in one call per projection over all (token, adapter, expert) runs; the layout
(a ``LoRABatchMeta`` over the virtual slots) is built once per layer and shared by its gate_up
and down calls. Rows of base tokens and of dense-only adapters are left out of it.
"""

from __future__ import annotations

import numpy as np
import torch

from loramux.adapters.experts import EXPERT_PARAMS, ROUTER, expert_shapes
from loramux.adapters.format import LoraWeights
from loramux.engine.lora.meta import LoRABatchMeta

GROUP_PARAM = {"gate_up": "gate_up_proj", "down": "down_proj"}

def expert_slot_bytes(dims, max_rank: int, element_size: int) -> int:
    """Bytes of one slot's expert part (0 for a dense base)."""
    if not dims.num_experts:
        return 0
    shapes = expert_shapes(dims)
    per_layer = sum(sum(shapes[p]) for p in EXPERT_PARAMS) * dims.num_experts * max_rank
    per_layer += sum(shapes[ROUTER]) * max_rank
    return len(dims.moe_layers) * per_layer * element_size


def expert_adapter_bytes(dims, rank: int, element_size: int) -> int:
    """Bytes of an adapter's expert LoRA at ``rank`` on both parameters (its CPU-tier copy)."""
    return expert_slot_bytes(dims, rank, element_size)


class ExpertSlots:
    """The experts' LoRA of every slot (see the module docstring)."""

    def __init__(self, dims, max_loras: int, max_rank: int, dtype: torch.dtype, device,
                 *, blockdiag: bool = True) -> None:
        """``blockdiag``: B as ``[.., E, R, N]`` (the torch backend's layout), else
        ``[.., E, N, R]`` (the Triton kernels')."""
        self.dims = dims
        self.max_rank = max_rank
        self.blockdiag = blockdiag
        shapes = expert_shapes(dims)
        e = dims.num_experts
        # CPU: untouched pages cost nothing until a slot with expert LoRA is written
        alloc = torch.empty if torch.device(device).type == "cpu" else torch.zeros
        self.a = {layer: {p: alloc(max_loras, e, max_rank, shapes[p][0], dtype=dtype, device=device)
                          for p in EXPERT_PARAMS} for layer in dims.moe_layers}
        self.b = {layer: {p: alloc(max_loras, e, *((max_rank, shapes[p][1]) if blockdiag else
                                                    (shapes[p][1], max_rank)), dtype=dtype, device=device)
                          for p in EXPERT_PARAMS} for layer in dims.moe_layers}
        self.has = np.zeros(max_loras, dtype=bool)
        """Slots whose adapter has expert LoRA (only those are read)."""
        self.ranks = torch.zeros(max_loras, dtype=torch.int64)
        """The largest expert-LoRA rank of each slot (0: none)."""
        h = dims.hidden_size
        self.router_a = {layer: alloc(max_loras, max_rank, h, dtype=dtype, device=device)
                         for layer in dims.moe_layers}  # [L, R, H] pre-scaled
        self.router_b = {layer: alloc(max_loras, max_rank, e, dtype=dtype, device=device)
                         for layer in dims.moe_layers}  # [L, R, E]
        self.has_router = np.zeros(max_loras, dtype=bool)
        """Slots whose adapter has LoRA on the router."""

    def write(self, slot: int, weights: LoraWeights) -> None:
        """Copy the adapter's expert LoRA into ``slot`` (called by ``SlotBuffers._write``)."""
        spec = weights.spec
        self.has[slot] = any(p in spec.target_parameters for p in EXPERT_PARAMS)
        self.ranks[slot] = max((a.shape[-2] for params in weights.experts.values()
                                for p, (a, _) in params.items() if p != ROUTER), default=0)
        self.has_router[slot] = ROUTER in spec.target_parameters
        if self.has_router[slot]:
            for layer in self.dims.moe_layers:
                a, b = self.router_a[layer][slot], self.router_b[layer][slot]
                a.zero_()
                b.zero_()
                wa, wb = weights.experts.get(layer, {}).get(ROUTER, (None, None))
                if wa is not None:
                    a[: wa.shape[0]].copy_(wa.to(a.dtype) * spec.expert_scale(ROUTER))
                    b[: wa.shape[0]].copy_(wb.t())
        if not self.has[slot]:
            return
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
                if self.blockdiag:
                    b[:, :r].copy_(wb.transpose(1, 2), non_blocking=True)
                else:
                    b[:, :, :r].copy_(wb, non_blocking=True)

    def clear(self, slot: int) -> None:
        self.has[slot] = False
        self.has_router[slot] = False
        self.ranks[slot] = 0

    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for d in (self.a, self.b) for g in d.values()
                   for t in g.values()) + sum(t.numel() * t.element_size() for d in
                                              (self.router_a, self.router_b) for t in d.values())


class ExpertStep:
    """One step's expert-LoRA layout: the model's :class:`~loramux.engine.model.moe.ExpertLoRAHook`
    through ``LoRAStepBatch``."""

    def __init__(self, slots: ExpertSlots, device, kernel) -> None:
        """``kernel``: the engine's LoRA kernel (``ops.lora_kernel``), for the slot layout the
        expert slots were built with (``ExpertSlots.blockdiag``)."""
        self.slots = slots
        self.device = device
        self._kernel = kernel
        e = slots.dims.num_experts
        self._virtual_ranks = torch.zeros(slots.has.shape[0] * e, dtype=torch.int64)
        self._ones = torch.ones(slots.has.shape[0] * e, dtype=torch.float32, device=device)
        self.clear()

    def prepare(self, token_slots: np.ndarray) -> None:
        """Lay out a step whose token t uses slot ``token_slots[t]`` (-1: none)."""
        self.clear()
        token_slots = np.asarray(token_slots, dtype=np.int64)
        used = np.unique(token_slots[token_slots >= 0])
        self._router_slots = [int(s) for s in used if self.slots.has_router[s]]
        if self._router_slots:
            self._token_slots = torch.from_numpy(token_slots).to(self.device)
        if used.size and self.slots.has[used].any():
            has = self.slots.has[np.maximum(token_slots, 0)] & (token_slots >= 0)
            self._host_slots = np.where(has, token_slots, -1)
            self._virtual_ranks = self.slots.ranks.repeat_interleave(self.slots.dims.num_experts)

    def clear(self) -> None:
        self._host_slots: np.ndarray | None = None  # [T] slot with expert LoRA per token, -1: none
        self._layer_meta: tuple[int, LoRABatchMeta] | None = None  # the layer's rows' layout
        self._router_slots: list[int] = []
        self._token_slots: torch.Tensor | None = None  # [T] (steps with router LoRA)

    def active(self, layer: int) -> bool:
        return (self._host_slots is not None or bool(self._router_slots)) and layer in self.slots.a

    def add_router(self, layer: int, x: torch.Tensor, logits: torch.Tensor) -> None:
        """``logits[t] +=`` the router LoRA of token t's adapter (x [T, H], logits [T, E]):
        one matmul pair per adapter of the step with router LoRA, over its tokens."""
        for slot in self._router_slots:
            rows = (self._token_slots == slot).nonzero().squeeze(1)
            a, b = self.slots.router_a[layer][slot], self.slots.router_b[layer][slot]  # [R, H], [R, E]
            delta = (x.index_select(0, rows).to(a.dtype) @ a.T) @ b  # [n, E]
            logits.index_add_(0, rows, delta.to(logits.dtype))

    def add(self, layer: int, group: str, x: torch.Tensor, y: torch.Tensor,
            tokens: torch.Tensor, counts: list[int]) -> None:
        """``y[j] +=`` row j's expert delta (rows sorted by expert, ``counts[e]`` each; row j is
        token ``tokens[j]``): one kernel call over the virtual slots ``slot * E + expert``."""
        if self._host_slots is None:
            return  # only router LoRA in this step
        p = GROUP_PARAM[group]
        a, b = self.slots.a[layer][p], self.slots.b[layer][p]  # [L, E, R, K], B: see ExpertSlots
        n_slots, e, r, k = a.shape
        meta = self._meta(layer, tokens, counts)
        if self.slots.blockdiag:
            self._kernel(y, x, a.view(n_slots * e, 1, r, k), b.view(n_slots * e, r, -1), meta, None,
                         [0, y.shape[1]])
        else:
            self._kernel(y, x, a.view(n_slots * e, 1, r, k), b.view(n_slots * e, -1, r), meta, self._ones,
                         [0, y.shape[1]])

    def _meta(self, layer: int, tokens: torch.Tensor, counts: list[int]) -> LoRABatchMeta:
        """The rows' layout over virtual slots ``slot * E + expert`` (-1: no expert adapter),
        built at a layer's gate_up call and reused by its down call (the same rows)."""
        if self._layer_meta is not None and self._layer_meta[0] == layer:
            return self._layer_meta[1]
        e = self.slots.dims.num_experts
        experts = np.repeat(np.arange(len(counts), dtype=np.int64), counts)  # [M]
        slots = self._host_slots[tokens.cpu().numpy()]  # [M]
        virtual = np.where(slots >= 0, slots * e + experts, -1)
        meta = LoRABatchMeta.build(virtual, self._virtual_ranks, self.device)
        self._layer_meta = (layer, meta)
        return meta
