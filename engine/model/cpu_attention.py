"""CPU paged attention through the compiled operator (``torch.ops.loramux.paged_attention``,
``csrc/paged_attention.c``).

The rows of a step that read cached context — decode tokens and prompt chunks that
continue a computed prefix — attend straight over their sequence's KV blocks: no per-layer
gather of whole contexts, an online softmax per block, GQA without repeating K/V, fp32
accumulation. Fresh prompts keep torch's causal SDPA over the step's own keys (already
in place). Used when :func:`kernel_available` is true, else the torch path in
``attention.py`` runs; both read the same cache layout ([S, Hkv, D] per layer).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from loramux.engine.model.kernels import loader
from loramux.engine.model.kernels import ops as kernels


def kernel_available() -> bool:
    """True when the compiled kernels are loaded and on (loads them on first call; logs why not)."""
    return loader.available()


@dataclass
class CpuAttentionMetadata:
    """The kernel's sequences of one step: built once per step, read by every layer."""

    tables: torch.Tensor  # [nseq, max_blocks] int32 block ids (padded with 0)
    row_start: torch.Tensor  # [nseq] int32 first row of the sequence in the step
    num_new: torch.Tensor  # [nseq] int32 rows (new tokens) of the sequence
    ctx_len: torch.Tensor  # [nseq] int32 context length after the step
    block_size: int
    window: int  # 0 = no sliding window

    @property
    def num_seqs(self) -> int:
        return int(self.row_start.shape[0])


def build_cpu_metadata(
    block_tables: list[list[int]],
    row_starts: list[int],
    starts: list[int],
    num_new: list[int],
    block_size: int,
    window: int | None,
) -> CpuAttentionMetadata:
    """Sequence ``i`` computes positions ``starts[i] .. starts[i] + num_new[i] - 1`` at step rows
    ``row_starts[i] ..``; its KV lives in ``block_tables[i]``."""
    ctx = [s + n for s, n in zip(starts, num_new, strict=True)]
    width = max((-(-c // block_size) for c in ctx), default=1)
    tables = np.zeros((len(block_tables), max(width, 1)), dtype=np.int32)
    for i, (t, c) in enumerate(zip(block_tables, ctx, strict=True)):
        used = -(-c // block_size)
        tables[i, :used] = t[:used]
    return CpuAttentionMetadata(
        torch.from_numpy(tables),
        torch.tensor(row_starts, dtype=torch.int32),
        torch.tensor(num_new, dtype=torch.int32),
        torch.tensor(ctx, dtype=torch.int32),
        block_size,
        window or 0,
    )


def cpu_paged_attention(
    q: torch.Tensor,  # [T, H, D] (any token stride; heads and dims contiguous, else copied)
    k_cache: torch.Tensor,  # [S, Hkv, D] contiguous
    v_cache: torch.Tensor,  # [S, Hkv, D]
    out: torch.Tensor,  # [T, H * D] contiguous, written for the metadata's rows
    meta: CpuAttentionMetadata,
    *,
    scale: float | None = None,
    window: int | None = None,
    softcap: float = 0.0,
) -> None:
    """Attention of the metadata's rows over their cached context, written into ``out``.
    ``scale``: softmax scale (default ``1 / sqrt(D)``); ``window``: sliding window of this call
    (default the metadata's; 0 = none); ``softcap``: attention logit soft-capping (0 = none)."""
    if meta.num_seqs == 0:
        return
    head_dim = q.shape[2]
    if q.stride(2) != 1 or q.stride(1) != head_dim:
        q = q.contiguous()
    kernels.paged_attention(
        q, k_cache, v_cache, out, meta.tables, meta.row_start, meta.num_new, meta.ctx_len,
        block_size=meta.block_size, scale=1.0 / math.sqrt(head_dim) if scale is None else scale,
        window=meta.window if window is None else window, softcap=softcap,
    )
