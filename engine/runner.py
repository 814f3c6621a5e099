"""Model runner: the execute phase of a step. Turns a plain-data SchedulerOutput into
tensors, lays out the step's adapters, runs the model and returns a ModelOutput of logits.

Owns the KV cache tensors. Rows of a step: decode sequences first (one token
each), then prefilling sequences (this step's chunk of their prompt, contiguous,
possibly continuing a prefix computed in earlier steps or found in the prefix
cache). Copy-on-write block copies of the plan run before the forward pass.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from loramux.engine.block_manager import pad_slot
from loramux.engine.config import CacheConfig
from loramux.engine.model.attention import build_step_attention
from loramux.engine.model.cpu_attention import kernel_available
from loramux.engine.model.decoder import DecoderModel
from loramux.engine.step_data import ModelOutput, ScheduledRow, SchedulerOutput

if TYPE_CHECKING:
    from loramux.engine.model.decoder import LoRAHook

logger = logging.getLogger(__name__)

_DEFAULT_CPU_KV_BYTES = 2 << 30


@dataclass
class StepBatch:
    """The rows of a step in the runner's order; row i of the logits belongs to ``rows[i]``."""

    rows: list[ScheduledRow]
    num_decode: int = 0  # rows 0..num_decode-1 decode one token; the rest prefill or verify

    @property
    def row_lora_keys(self) -> list[str | None]:
        return [r.lora_key for r in self.rows]

    @property
    def num_new_tokens(self) -> list[int]:
        return [r.num_new_tokens for r in self.rows]

    def lora_runs(self) -> tuple[list[str | None], list[int]]:
        """The step's tokens in batch order as runs of one adapter each: (adapter or None,
        tokens). A row whose adapter starts after its first position (an activated LoRA,
        ``ScheduledRow.lora_start``) gives its tokens before the start to no adapter."""
        keys: list[str | None] = []
        counts: list[int] = []
        for r in self.rows:
            n = r.num_new_tokens
            pre = 0 if r.lora_key is None else min(max(r.lora_start - r.num_computed_tokens, 0), n)
            if pre:
                keys.append(None)
                counts.append(pre)
            if n > pre:
                keys.append(r.lora_key)
                counts.append(n - pre)
        return keys, counts


class StepAdapters(Protocol):
    """What the runner asks of the adapter manager for each step."""

    hook: LoRAHook | None
    """What the model calls per LoRA layer (None: no LoRA layers run)."""

    @property
    def slot_of(self) -> Mapping[str, int]:
        """Adapter -> device slot of the resident adapters."""

    def prepare_step(self, row_lora_keys: Sequence[str | None], row_num_tokens: Sequence[int]) -> None:
        """Lay out a step's adapters, before its forward pass: its tokens in batch order as
        runs of ``row_num_tokens[i]`` tokens of adapter ``row_lora_keys[i]`` (None: none)."""

    def finish_step(self) -> None:
        """After the step's forward pass (also a failed one)."""


def plan_num_blocks(model: DecoderModel, cache: CacheConfig, max_model_len: int, max_num_seqs: int) -> int:
    """How many KV blocks fit the configured memory."""
    if cache.num_gpu_blocks_override is not None:
        return cache.num_gpu_blocks_override
    per_block = model.kv_bytes_per_token() * cache.block_size
    if model.device.type == "cuda":
        free, total = torch.cuda.mem_get_info(model.device)
        budget = total * cache.gpu_memory_utilization - (total - free) - (1 << 30)
        if budget < per_block:
            raise ValueError(
                "no memory left for the KV cache: raise gpu_memory_utilization "
                f"(now {cache.gpu_memory_utilization})"
            )
    elif cache.kv_cache_memory is not None:
        budget = cache.kv_cache_memory
    else:
        want = max_num_seqs * (max_model_len + cache.block_size) * model.kv_bytes_per_token()
        budget = min(_DEFAULT_CPU_KV_BYTES, want)
    blocks = int(budget // per_block)
    if blocks < 1:
        raise ValueError(
            f"kv_cache_memory of {budget} bytes holds no block of {cache.block_size} tokens "
            f"({per_block} bytes each)"
        )
    return blocks


class ModelRunner:
    """Builds the step's tensors and runs the forward pass."""

    def __init__(
        self, model: DecoderModel, num_blocks: int, block_size: int, attention_backend: str = "auto",
        adapters: StepAdapters | None = None,
    ) -> None:
        """``adapters``: the adapter slots of the steps (None: base-model rows only)."""
        self.model = model
        self.adapters = adapters
        # CPU: the compiled kernel reads K/V blocks in place (installed with the package; logged fallback)
        self.cpu_kernel = (
            model.device.type == "cpu" and attention_backend == "auto" and kernel_available()
        )
        if model.device.type == "cpu":
            logger.info("CPU attention: %s", "C paged kernel" if self.cpu_kernel else "torch")
        self.block_size = block_size
        self.num_blocks = num_blocks
        d = model.local_dims  # under tensor parallelism: this rank's KV heads
        self.pad_slot = pad_slot(num_blocks, block_size)
        slots = self.pad_slot + 1  # the last slot is the zeroed one padding reads
        self.kv_caches = [
            (
                torch.zeros(slots, d.num_kv_heads, d.head_dim, dtype=model.dtype, device=model.device),
                torch.zeros(slots, d.num_kv_heads, d.head_dim, dtype=model.dtype, device=model.device),
            )
            for _ in range(d.num_layers)
        ]

    def reset(self) -> None:
        """After the engine's loop died (``LLMEngine.reset``): one process has nothing to
        rebuild (the KV contents are dropped with the engine's block bookkeeping)."""

    def order(self, plan: SchedulerOutput, slot_of: Mapping[str, int]) -> StepBatch:
        """Decode rows first, then prefills and verify rows (speculative decoding: several
        tokens after a computed context, attended as a prompt chunk is); within each, grouped
        by adapter slot (``slot_of``: the resident adapters' slots; base-model rows last) so
        the LoRA tokens lead the batch in slot order and the LoRA kernels read them in place."""
        decode = [r for r in plan.scheduled if not r.is_prefill and not r.num_draft_tokens]
        prefill = [r for r in plan.scheduled if r.is_prefill or r.num_draft_tokens]
        if slot_of:
            def key(r: ScheduledRow) -> int:
                return slot_of[r.lora_key] if r.lora_key is not None else 1 << 30

            decode.sort(key=key)
            prefill.sort(key=key)
        return StepBatch(decode + prefill, len(decode))

    def execute(self, plan: SchedulerOutput) -> ModelOutput:
        """The execute phase: order the plan's rows, lay out their adapters, run the model; a
        batch-level failure (e.g. an allocation) comes back as ``ModelOutput.error``."""
        adapters = self.adapters
        try:
            batch = self.order(plan, adapters.slot_of if adapters is not None else {})
            if adapters is None:
                return ModelOutput(batch.rows, *self.run_batch(batch, plan.copies))
            adapters.prepare_step(*batch.lora_runs())
            try:
                return ModelOutput(batch.rows, *self.run_batch(batch, plan.copies))
            finally:
                adapters.finish_step()
        except Exception as exc:
            logger.exception("engine step failed; failing its %d sequences", len(plan.scheduled))
            return ModelOutput(plan.scheduled, error=exc)

    @torch.inference_mode()
    def run_batch(
        self, batch: StepBatch, copies: list[tuple[int, int]] = ()
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor], dict[int, torch.Tensor]]:
        """Run one step after copying the ``copies`` blocks (copy-on-write). Returns logits
        [B, V] fp32 for the last token of each sequence, for sequences that asked for
        prompt logprobs (row -> logits [P - 1, V] of their prompt positions 0..P-2), and for
        verify rows (row -> logits [k, V] of their positions before the last)."""
        dev = self.model.device
        if copies:
            self._copy_blocks(copies)
        rows = batch.rows
        ids: list[int] = []
        starts: list[int] = []
        counts: list[int] = []
        for r in rows:
            ids.extend(r.token_ids)
            starts.append(r.num_computed_tokens)
            counts.append(r.num_new_tokens)
        attn = build_step_attention(
            [r.block_ids for r in rows],
            starts,
            counts,
            batch.num_decode,
            self.block_size,
            self.model.attention_windows,
            dev,
            pad_slot=self.pad_slot,
            cpu_kernel=self.cpu_kernel,
        )
        counts_t = torch.tensor(counts)
        ends = torch.cumsum(counts_t, 0)  # [B]
        # token t of row i sits at starts[i] + (t - first token of row i)
        shift = torch.repeat_interleave(torch.tensor(starts) - (ends - counts_t), counts_t)  # [T]
        positions = torch.arange(len(ids)) + shift  # [T]
        # [T] each token's prompt length: the rotary of some models depends on it (LongRoPE)
        prompt_lens = torch.repeat_interleave(torch.tensor([r.num_prompt_tokens for r in rows]), counts_t)
        logit_rows = [ends - 1]
        prompt_rows: dict[int, tuple[int, int]] = {}  # row -> (offset in logits, count)
        draft_rows: dict[int, tuple[int, int]] = {}
        offset = len(rows)
        for i, r in enumerate(rows):
            for wanted, into in ((r.num_prompt_logits, prompt_rows), (r.num_draft_tokens, draft_rows)):
                if wanted:
                    start = int(ends[i]) - r.num_new_tokens
                    logit_rows.append(torch.arange(start, start + wanted))
                    into[i] = (offset, wanted)
                    offset += wanted
        logits = self.model.forward(
            torch.tensor(ids, dtype=torch.long, device=dev),
            positions.to(dev),
            attn,
            self.kv_caches,
            torch.cat(logit_rows).to(dev),
            prompt_lens.to(dev),
            lora=self.adapters.hook if self.adapters is not None else None,
        )
        b = len(rows)
        extra = {row: logits[o : o + c] for row, (o, c) in prompt_rows.items()}
        drafts = {row: logits[o : o + c] for row, (o, c) in draft_rows.items()}
        return logits[:b], extra, drafts

    def _copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        bs = self.block_size
        src = torch.tensor([s for s, _ in copies])
        dst = torch.tensor([d for _, d in copies])
        ar = torch.arange(bs)
        src_slots = (src[:, None] * bs + ar).reshape(-1).to(self.model.device)
        dst_slots = (dst[:, None] * bs + ar).reshape(-1).to(self.model.device)
        for k_cache, v_cache in self.kv_caches:
            k_cache.index_copy_(0, dst_slots, k_cache.index_select(0, src_slots))
            v_cache.index_copy_(0, dst_slots, v_cache.index_select(0, src_slots))
