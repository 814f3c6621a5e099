"""Device slot buffers: stacked LoRA A/B weights for every projection group.

For layer ``l`` and group ``g`` (qkv, o, gate_up, down):
``a[l][g]``: [max_loras, num_slices, max_lora_rank, K] and
``b[l][g]``: [max_loras, N_total, max_lora_rank] (slices' rows concatenated; the layout of
the Triton kernels) or, with ``blockdiag`` (the torch backend), [max_loras, num_slices *
max_lora_rank, N_total] holding each slice's B.T on the block diagonal, with A already
multiplied by the adapter's scale; plus a
per-slot ``scale`` [max_loras] fp32 and ``ranks`` [max_loras] int64 (0 = empty).
Rows/columns beyond an adapter's rank, and modules it does not target, are zero.

DoRA (``engine/lora/dora.py``): ``row_gain[l][g]`` [max_loras + 1, N_total] holds a
DoRA slot's per-row scale as ``g - 1`` (0 on rows its adapter leaves alone; the last row is
all zeros, for rows of other adapters), so that ``y + y ⊙ (g - 1)`` keeps the small learned
deviations exact in bfloat16 too; ``row_shift[(l, g)]``, the same shape, its bias
correction, made when a DoRA adapter first meets a base projection with a bias; ``dora[slot]``
the ``(layer, group)`` pairs the slot's adapter scales (empty for a plain LoRA). Both are
kept in the projections' output dtype (``scale_dtype``: the model's), computed in float32 at
load and rounded once here, so the scale meets ``y`` with no conversion per step.

A LoRA on a fused checkpoint projection (Phi-3's ``qkv_proj``: A ``[r, H]``, B ``[q + 2kv, r]``)
fills every slice of its group: the same A in each slice, B split by the slices' rows.
"""

from __future__ import annotations

from typing import Protocol

import torch

from loramux.adapters.arch import GROUP_FUSED_MODULE, PROJECTION_GROUPS
from loramux.adapters.format import LoraWeights
from loramux.engine.lora.experts import ExpertSlots
from loramux.engine.lora.norms import NormSlots
from loramux.engine.lora.sharded import SlotLayout
from loramux.engine.lora.vocab import VocabSlots
from loramux.engine.model.weights import ModelDims


class SlotMirror(Protocol):
    """What hears a rank's slot writes to repeat them elsewhere."""

    def wrote(self, slot: int, weights: LoraWeights) -> None:
        """``weights`` (the whole adapter) were written into ``slot``."""

    def cleared(self, slot: int) -> None:
        """``slot`` was emptied."""


class SlotBuffers:
    """The stacked weights that the LoRA kernels read."""

    def __init__(
        self, dims: ModelDims, max_loras: int, max_rank: int, dtype: torch.dtype, device,
        *, blockdiag: bool = False, scale_dtype: torch.dtype = torch.float32, shard=None,
        fully_sharded: bool = False,
    ) -> None:
        """``dims``: the projections' shapes on this rank (its ``local_dims`` under tensor
        parallelism, ``shard`` its ``TensorShard``); ``fully_sharded`` (with a shard and the
        block-diagonal layout): vLLM's ``fully_sharded_loras``, the S-LoRA layout
        (``sharded.py``): column-parallel groups keep ``max_rank / world`` rank rows of A,
        row-parallel ones this rank's ``1 / world`` of B's output columns."""
        self.dims = dims
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.dtype, self.scale_dtype = dtype, scale_dtype
        shapes = dims.module_shapes()
        self.slice_offsets: dict[str, list[int]] = dims.group_offsets()
        self.a: list[dict[str, torch.Tensor]] = []
        self.b: list[dict[str, torch.Tensor]] = []
        self.row_shift: dict[tuple[int, str], torch.Tensor] = {}
        self.blockdiag = blockdiag
        self.shard = shard
        """Under tensor parallelism, this rank's share (``TensorShard``): an adapter is cut to
        it as it is written (the buffers are built with the rank's ``local_dims``)."""
        self.fully_sharded = fully_sharded and shard is not None
        self.layout = SlotLayout(dims, max_rank, shard if self.fully_sharded else None)
        """Each group's A rank rows and B columns (``sharded.SlotLayout``)."""
        if self.fully_sharded and not blockdiag:
            raise ValueError("fully_sharded_loras runs on the block-diagonal slot layout (the torch backend)")
        # The torch backend on the CPU: slots start uninitialised, so a capacity derived from
        # memory costs pages only as slots fill (``_write`` zeroes a slot before filling it,
        # and no kernel reads a slot that is not in the step's segments).
        alloc = torch.empty if blockdiag and torch.device(device).type == "cpu" else torch.zeros
        for _ in range(dims.num_layers):
            a_layer, b_layer = {}, {}
            for group, modules in PROJECTION_GROUPS.items():
                k = shapes[modules[0]][0]
                n = self.layout.b_offsets[group][-1]
                a_layer[group] = alloc(
                    max_loras, len(modules), self.layout.a_rows[group], k, dtype=dtype, device=device
                )
                if blockdiag:
                    b_layer[group] = alloc(
                        max_loras, len(modules) * max_rank, n, dtype=dtype, device=device
                    )
                else:
                    b_layer[group] = alloc(max_loras, n, max_rank, dtype=dtype, device=device)
            self.a.append(a_layer)
            self.b.append(b_layer)
        self.row_gain_stack: dict[str, torch.Tensor] = {}
        """Per group, every layer's row gains [num_layers, max_loras + 1, N_total]
        (``row_gain[l][g]`` are its views; a step gathers its rows for all layers at once)."""
        for group in PROJECTION_GROUPS:
            g = alloc(dims.num_layers, max_loras + 1, self.slice_offsets[group][-1], dtype=scale_dtype,
                      device=device)
            g[:, max_loras].zero_()
            self.row_gain_stack[group] = g
        self.row_gain = [{group: self.row_gain_stack[group][layer] for group in PROJECTION_GROUPS}
                         for layer in range(dims.num_layers)]
        self.experts = (ExpertSlots(dims, max_loras, max_rank, dtype, device, blockdiag=blockdiag)
                        if dims.num_experts else None)
        """The experts' LoRA of each slot on an MoE base (``experts.py``)."""
        self.vocab = VocabSlots(dtype, device, getattr(dims, "tie_word_embeddings", False),
                                getattr(dims, "vocab_size", 0), dims.hidden_size)
        """Each slot's embedding / lm_head LoRA and trainable tokens (``vocab.py``)."""
        self.norms = NormSlots(scale_dtype, device)
        """Each slot's own norms (``modules_to_save``; ``norms.py``)."""
        self.scale = torch.zeros(max_loras, dtype=torch.float32, device=device)
        self.ranks = torch.zeros(max_loras, dtype=torch.int64)
        self.groups: list[frozenset[str]] = [frozenset()] * max_loras
        """Projection groups each slot's adapter targets (others are all zero)."""
        self.dora: list[frozenset[tuple[int, str]]] = [frozenset()] * max_loras
        """Per slot, the ``(layer, group)`` pairs its DoRA adapter scales (empty: plain LoRA)."""
        self.mirror: SlotMirror | None = None
        """Rank 0 under tensor parallelism: told of every write and clear (whole adapters), to
        repeat them on the other ranks."""
        # CUDA: slot writes run on a side stream; the forward pass waits on ``ready``.
        dev = torch.device(device)
        self.stream = torch.cuda.Stream(dev) if dev.type == "cuda" else None
        self.ready = None

    def write(self, slot: int, weights: LoraWeights) -> None:
        """Copy an adapter into ``slot`` (zeroing whatever was there); on CUDA the copy
        runs on a side stream and :meth:`wait_ready` orders it before the next forward."""
        r = weights.spec.r
        if weights.spec.max_rank > self.max_rank:
            raise ValueError(f"adapter rank {weights.spec.max_rank} exceeds max_lora_rank {self.max_rank}")
        if weights.spec.use_dora and not weights.dora_scales:
            raise ValueError("a DoRA adapter needs its per-row scales (dora.dora_scales) first")
        self.vocab.check(weights, slot)
        self.norms.entries(weights)  # raises for a norm the model has not
        whole = weights
        if self.shard is not None:
            weights = self.shard.lora(weights, self.layout.rank_share)
        if self.mirror is not None:
            self.mirror.wrote(slot, whole)
        if self.stream is None:
            self._write(slot, weights, r)
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))
        with torch.cuda.stream(self.stream):
            self._write(slot, weights, r)
            self.ready = torch.cuda.Event()
            self.ready.record(self.stream)

    def wait_ready(self) -> None:
        """Make the compute stream wait for pending slot writes (called once per step)."""
        if self.ready is not None:
            torch.cuda.current_stream(self.stream.device).wait_event(self.ready)
            self.ready = None

    def _write(self, slot: int, weights: LoraWeights, r: int) -> None:
        self.groups[slot] = frozenset(
            g for g, names in PROJECTION_GROUPS.items()
            if any(n in modules for modules in weights.layers.values()
                   for n in (*names, GROUP_FUSED_MODULE.get(g)))
        )
        for layer in range(self.dims.num_layers):
            modules = weights.layers.get(layer, {})
            for group, names in PROJECTION_GROUPS.items():
                a = self.a[layer][group][slot]
                b = self.b[layer][group][slot]
                a.zero_()
                b.zero_()
                offs = self.layout.b_offsets[group]
                fused = modules.get(GROUP_FUSED_MODULE.get(group))
                for s, name in enumerate(names):
                    pair = modules.get(name)
                    if fused is not None:  # one A for every slice, B by the slice's rows
                        pair = (fused[0], fused[1][offs[s] : offs[s + 1]])
                    if pair is None:
                        continue
                    wa, wb = pair
                    if self.blockdiag:  # the torch backend reads A pre-scaled
                        wa = wa.to(a.dtype) * weights.spec.scale
                    a[s, : wa.shape[0]].copy_(wa, non_blocking=True)  # fully sharded: A's rank rows
                    if self.blockdiag:
                        rows = slice(s * self.max_rank, s * self.max_rank + r)
                        b[rows, offs[s] : offs[s + 1]].copy_(wb.t(), non_blocking=True)
                    else:
                        b[offs[s] : offs[s + 1], :r].copy_(wb, non_blocking=True)
        self.dora[slot] = self._write_dora(slot, weights) if weights.spec.use_dora else frozenset()
        if self.experts is not None:
            self.experts.write(slot, weights)
        self.vocab.write(slot, weights)
        self.norms.write(slot, weights)
        self.scale[slot] = weights.spec.scale
        self.ranks[slot] = r

    def _write_dora(self, slot: int, weights: LoraWeights) -> frozenset[tuple[int, str]]:
        """Write a DoRA adapter's per-row scales (and bias corrections) into ``slot``."""
        cells = set()
        for layer in range(self.dims.num_layers):
            modules = weights.dora_scales.get(layer, {})
            for group, names in PROJECTION_GROUPS.items():
                g_row = self.row_gain[layer][group][slot]
                g_row.zero_()
                shift = self.row_shift.get((layer, group))
                if shift is not None:
                    shift[slot].zero_()
                offs = self.slice_offsets[group]
                fused = GROUP_FUSED_MODULE.get(group)
                for name in (*names, fused):
                    if name not in modules:
                        continue
                    rows = (slice(0, offs[-1]) if name == fused or len(names) == 1
                            else slice(offs[names.index(name)], offs[names.index(name) + 1]))
                    g, c = modules[name]
                    g_row[rows].copy_(g - 1, non_blocking=True)
                    if c is not None:
                        if shift is None:
                            shift = torch.zeros_like(self.row_gain[layer][group])
                            self.row_shift[(layer, group)] = shift
                        shift[slot, rows].copy_(c, non_blocking=True)
                    cells.add((layer, group))
        return frozenset(cells)

    def clear(self, slot: int) -> None:
        """Mark ``slot`` empty (its weights are overwritten by the next write)."""
        if self.mirror is not None:
            self.mirror.cleared(slot)
        self.ranks[slot] = 0
        self.scale[slot] = 0.0
        self.groups[slot] = frozenset()
        self.dora[slot] = frozenset()
        if self.experts is not None:
            self.experts.clear(slot)
        self.vocab.clear(slot)
        self.norms.clear(slot)

    def num_bytes(self) -> int:
        """Bytes of the slots: A/B stacks, DoRA's row gains, the experts' LoRA, the vocabulary parts
        (:func:`capacity.slot_bytes` per slot), plus any DoRA bias corrections made since (the
        gains' one shared zero row is not counted)."""
        return sum(
            t.numel() * t.element_size() for layer in self.a + self.b for t in layer.values()
        ) + sum(
            t[:, : self.max_loras].numel() * t.element_size() for t in self.row_gain_stack.values()
        ) + sum(t.numel() * t.element_size() for t in self.row_shift.values()) + (
            self.experts.num_bytes() if self.experts is not None else 0) + self.vocab.num_bytes() + (
            self.norms.num_bytes())
