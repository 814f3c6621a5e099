"""Model runner: turns a SchedulerOutput into tensors, runs the model, returns logits.

Owns the KV cache tensors. Rows of a step: decode sequences first (one token
each), then prefilling sequences (this step's chunk of their prompt, contiguous,
possibly continuing a prefix computed in earlier steps or found in the prefix
cache). Copy-on-write block copies of the plan run before the forward pass.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from loramux.engine.block_manager import pad_slot
from loramux.engine.config import CacheConfig
from loramux.engine.model.attention import build_step_attention, cpu_kernel_takes
from loramux.engine.model.cpu_attention import kernel_available
from loramux.engine.model.decoder import DecoderModel
from loramux.engine.scheduler import SchedulerOutput
from loramux.engine.sequence import Sequence

logger = logging.getLogger(__name__)

_DEFAULT_CPU_KV_BYTES = 2 << 30


@dataclass
class StepBatch:
    """The order of sequences in a step; row i of the logits belongs to ``seqs[i]``."""

    seqs: list[Sequence]
    num_new_tokens: list[int]
    token_lora_keys: list[str | None]  # per token, in row order
    num_decode: int = 0  # rows 0..num_decode-1 decode one token; the rest prefill


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
        self, model: DecoderModel, num_blocks: int, block_size: int, attention_backend: str = "auto"
    ) -> None:
        self.model = model
        # CPU: the C kernel reads K/V blocks in place (built at start-up; logged fallback)
        self.cpu_kernel = (
            model.device.type == "cpu" and attention_backend == "auto"
            and cpu_kernel_takes(model.attn_softcap) and kernel_available()
        )
        if model.device.type == "cpu":
            logger.info("CPU attention: %s", "C paged kernel" if self.cpu_kernel else "torch")
        self.block_size = block_size
        self.num_blocks = num_blocks
        d = model.dims
        self.pad_slot = pad_slot(num_blocks, block_size)
        slots = self.pad_slot + 1  # the last slot is the zeroed one padding reads
        self.kv_caches = [
            (
                torch.zeros(slots, d.num_kv_heads, d.head_dim, dtype=model.dtype, device=model.device),
                torch.zeros(slots, d.num_kv_heads, d.head_dim, dtype=model.dtype, device=model.device),
            )
            for _ in range(d.num_layers)
        ]

    def order(self, out: SchedulerOutput, slot_of: Callable[[str], int] | None = None) -> StepBatch:
        """Decode rows first, then prefills; within each, grouped by adapter slot (base-model
        rows last) so the LoRA tokens lead the batch in slot order and the LoRA kernels read
        them in place."""
        decode = [s for s in out.scheduled if not s.is_prefill]
        prefill = [s for s in out.scheduled if s.is_prefill]
        if slot_of is not None:
            def key(s):
                return slot_of(s.seq.lora_key) if s.seq.lora_key is not None else 1 << 30

            decode.sort(key=key)
            prefill.sort(key=key)
        items = decode + prefill
        keys: list[str | None] = []
        for s in items:
            keys.extend([s.seq.lora_key] * s.num_new_tokens)
        return StepBatch([s.seq for s in items], [s.num_new_tokens for s in items], keys, len(decode))

    @torch.inference_mode()
    def execute(
        self, batch: StepBatch, copies: list[tuple[int, int]] = ()
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """Run one step after copying the ``copies`` blocks (copy-on-write). Returns logits
        [B, V] fp32 for the last token of each sequence, and for sequences that asked for
        prompt logprobs (row -> logits [P - 1, V] of their prompt positions 0..P-2)."""
        dev = self.model.device
        if copies:
            self._copy_blocks(copies)
        ids: list[int] = []
        starts: list[int] = []
        for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
            start = seq.num_computed_tokens
            ids.extend(seq.token_ids[start : start + n])
            starts.append(start)
        positions = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, batch.num_new_tokens, strict=True)])
        attn = build_step_attention(
            [s.block_table for s in batch.seqs],
            starts,
            batch.num_new_tokens,
            batch.num_decode,
            self.block_size,
            self.model.attention_windows,
            dev,
            pad_slot=self.pad_slot,
            cpu_kernel=self.cpu_kernel,
        )
        prompt_lens = torch.repeat_interleave(
            torch.tensor([s.num_prompt_tokens for s in batch.seqs]), torch.tensor(batch.num_new_tokens)
        )  # [T]: the rotary of some models depends on it (LongRoPE)
        ends = torch.cumsum(torch.tensor(batch.num_new_tokens), 0)
        rows = [ends - 1]
        prompt_rows: dict[int, tuple[int, int]] = {}  # row -> (offset in logits, count)
        offset = len(batch.seqs)
        for row, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens, strict=True)):
            if seq.params.prompt_logprobs is not None and seq.prompt_logprobs is None and n > 1:
                count = seq.num_prompt_tokens - 1
                start = int(ends[row]) - n
                rows.append(torch.arange(start, start + count))
                prompt_rows[row] = (offset, count)
                offset += count
        logits = self.model.forward(
            torch.tensor(ids, dtype=torch.long, device=dev),
            positions.to(dev),
            attn,
            self.kv_caches,
            torch.cat(rows).to(dev),
            prompt_lens.to(dev),
        )
        b = len(batch.seqs)
        extra = {row: logits[o : o + c] for row, (o, c) in prompt_rows.items()}
        return logits[:b], extra

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
