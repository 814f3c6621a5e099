"""The per-step LoRA batch: the model's ``LoRAHook``.

Once per step (:meth:`LoRAStepBatch.prepare`, from ``LoRAManager.prepare_step``) the rows'
slots become one :class:`LoRABatchMeta`; then every projection group of every layer calls
:meth:`LoRAStepBatch.add`, which runs the kernel chosen once when the engine started (no
backend lookup per layer call) on the slot buffers; on the CPU with the compiled kernels the
step's SGMV calls are laid out at prepare (``ops/cpu_step.SgmvStep``), so each layer call is one
operator call; then the step's DoRA rows are scaled (:class:`~loramux.engine.lora.dora.DoraStep`;
nothing when the step has none). Runs on the engine thread.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch

from loramux.engine.lora import ops, sharded
from loramux.engine.lora.dora import DoraStep
from loramux.engine.lora.experts import ExpertStep
from loramux.engine.lora.meta import LoRABatchMeta
from loramux.engine.lora.norms import NormFn, NormKey, NormStep
from loramux.engine.lora.ops import cpu_step
from loramux.engine.lora.slots import SlotBuffers
from loramux.engine.lora.vocab import VocabStep


def lay_out_step(buffers: SlotBuffers, hook: LoRAStepBatch, slot_of: Mapping[str, int],
                 row_lora_keys: Sequence[str | None], row_num_tokens: Sequence[int]) -> None:
    """Lay out a step's adapters in ``hook`` (once per step, before the forward pass): its
    tokens in batch order are runs of ``row_num_tokens[i]`` tokens of adapter
    ``row_lora_keys[i]`` (None: none), each in its slot ``slot_of[key]``."""
    keys = frozenset(k for k in row_lora_keys if k is not None)
    if not keys:
        hook.clear()
        return
    buffers.wait_ready()
    row_slots = [slot_of[k] if k is not None else -1 for k in row_lora_keys]
    groups = frozenset().union(*(buffers.groups[slot_of[k]] for k in keys))
    hook.prepare(keys, row_slots, row_num_tokens, groups)


class LoRAStepBatch:
    """This step's adapter layout and the layer hook that reads it."""

    def __init__(self, buffers: SlotBuffers, backend: str, device: torch.device) -> None:
        """``backend``: ``torch`` or ``triton`` (resolved by the manager, once)."""
        self.buffers = buffers
        self.device = device
        self._kernel = ops.lora_kernel(backend, blockdiag=buffers.blockdiag)
        self._triton = backend == "triton"
        self._scale = None if buffers.blockdiag else buffers.scale  # block-diagonal: A pre-scaled
        self._meta: LoRABatchMeta | None = None
        self._dora: DoraStep | None = None
        self._vocab: VocabStep | None = None
        self._norms: NormStep | None = None
        # the CPU kernel's per-step calls (cpu_step.SgmvStep) where the slots suit it
        self._cpu_sgmv = (backend == "torch" and buffers.blockdiag and torch.device(device).type == "cpu"
                          and cpu_step.slots_fit(buffers.a, buffers.b))
        self._slot_dtype = next(iter(buffers.a[0].values())).dtype if self._cpu_sgmv else None
        self._sgmv: cpu_step.SgmvStep | None = None
        self._fully_sharded = getattr(buffers, "fully_sharded", False)
        self.experts = (ExpertStep(buffers.experts, device, self._kernel)
                        if buffers.experts is not None else None)
        """The experts' LoRA of the step on an MoE base (``experts.py``)."""
        self._groups: frozenset[str] = frozenset()
        self.keys: frozenset[str] = frozenset()
        """The adapters of the step in flight (their slots are busy until :meth:`clear`)."""

    def prepare(self, keys: frozenset[str], row_slots: Sequence[int], row_tokens: Sequence[int],
                groups: frozenset[str]) -> None:
        """Lay out a step whose row i has ``row_tokens[i]`` tokens on slot ``row_slots[i]``
        (-1 = no adapter); ``keys``: its adapters, ``groups``: the projection groups they
        target (the others are skipped, e.g. for q/v-only adapters)."""
        self.keys = keys
        self._groups = groups
        token_slots = np.repeat(np.asarray(row_slots, dtype=np.int64), row_tokens)  # [T]
        self._meta = LoRABatchMeta.build(token_slots, self.buffers.ranks, self.device)
        self._sgmv = (cpu_step.SgmvStep(self._meta, self.buffers.slice_offsets, self._slot_dtype)
                      if self._cpu_sgmv and cpu_step.SgmvStep.usable(self._meta) else None)
        dora = self.buffers.dora
        runs = [run for run in self._meta.runs if dora[run[2]]]
        self._dora = DoraStep(runs, self.buffers, self.device, triton=self._triton) if runs else None
        if self.experts is not None:
            self.experts.prepare(token_slots)
        vocab = [s for s in sorted(set(row_slots)) if s >= 0 and self.buffers.vocab.has(s)]
        self._vocab = VocabStep(self.buffers.vocab, self._meta.token_slots, vocab) if vocab else None
        norms = [s for s in sorted(set(row_slots)) if s >= 0 and self.buffers.norms.has(s)]
        self._norms = NormStep(self.buffers.norms, self._meta.token_slots, norms) if norms else None

    def clear(self) -> None:
        """The step is over (or has no adapter): nothing is added until the next prepare."""
        self.keys = frozenset()
        self._meta = None
        self._dora = None
        self._vocab = None
        self._norms = None
        self._sgmv = None
        self._groups = frozenset()
        if self.experts is not None:
            self.experts.clear()

    @property
    def meta(self) -> LoRABatchMeta | None:
        """This step's layout (None between steps and in steps without adapters)."""
        return self._meta

    def active(self) -> bool:
        """True when this step has tokens with an adapter (the model skips the hook else)."""
        return self._meta is not None and self._meta.has_lora

    def add(self, layer: int, group: str, x: torch.Tensor, y: torch.Tensor) -> None:
        """``y += `` this step's adapters' delta for ``x`` in projection ``group`` of ``layer``."""
        if group not in self._groups:
            return
        b = self.buffers
        if self._fully_sharded:  # the S-LoRA layout under tensor parallelism (sharded.py)
            if group in sharded.COLUMN_GROUPS:
                sharded.add_column(y, x, b.a[layer][group], b.b[layer][group], self._meta.runs, b.shard)
            else:
                sharded.add_row(y, x, b.a[layer][group], b.b[layer][group], self._meta.runs,
                                b.layout.out_start[group])
        elif self._sgmv is None or not self._sgmv.add(group, y, x, b.a[layer][group], b.b[layer][group]):
            self._kernel(y, x, b.a[layer][group], b.b[layer][group], self._meta, self._scale,
                         b.slice_offsets[group])
        if self._dora is not None:
            self._dora.apply(layer, group, y)

    def embed(self, input_ids: torch.Tensor, residual: torch.Tensor) -> None:
        """The embedding rows ``residual`` of ``input_ids``: each adapter's embedding LoRA and
        trainable tokens on its own tokens (``vocab.py``; nothing without them)."""
        if self._vocab is not None:
            self._vocab.embed(input_ids, residual)

    def head(self, hidden: torch.Tensor, logits: torch.Tensor, logits_rows: torch.Tensor) -> None:
        """The logits of the normalized ``hidden`` states of tokens ``logits_rows``: each
        adapter's lm_head LoRA and trainable-token columns on its own rows."""
        if self._vocab is not None:
            self._vocab.head(hidden, logits, logits_rows)

    def norm(self, key: NormKey, fn: NormFn, source: torch.Tensor, out: torch.Tensor,
             rows: torch.Tensor | None = None) -> None:
        """The norm ``key`` of ``source``, ``out``: recomputed with each adapter's own copy on its
        own rows (``norms.py``; nothing without them). ``rows``: ``source``'s batch tokens."""
        if self._norms is not None:
            self._norms.apply(key, fn, source, out, rows)

    def experts_active(self, layer: int) -> bool:
        """True when this step has tokens whose adapter carries LoRA on ``layer``'s experts."""
        return self.experts is not None and self.experts.active(layer)

    def add_experts(self, layer: int, group: str, x: torch.Tensor, y: torch.Tensor,
                    tokens: torch.Tensor, counts: list[int]) -> None:
        """The MoE block's hook (``moe.ExpertLoRAHook``): ``y += `` each expert-sorted row's delta."""
        self.experts.add(layer, group, x, y, tokens, counts)

    def add_router(self, layer: int, x: torch.Tensor, logits: torch.Tensor) -> None:
        """The MoE router's hook: ``logits += `` each token's adapter's router LoRA delta."""
        self.experts.add_router(layer, x, logits)
