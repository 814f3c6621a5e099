"""The vocabulary-parallel embedding and ``lm_head``: each rank holds the rows of its share of
the token ids (``TensorShard.vocab_range``).

The embedding looks up the ids in this rank's rows (zeros for the others') and one
all-reduce gives every rank every token's row. ``lm_head`` gives each rank its columns of
the logits; rank 0 gathers them into ``[B, vocab]`` and samples (the adapters' vocabulary
parts, the soft-cap and the overflow check then run there on the whole logits).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from loramux.engine.distributed import group
from loramux.engine.distributed.shard import TensorShard
from loramux.engine.model.weights import ModelDims


class VocabParallel:
    """One rank's embedding lookups and logits under tensor parallelism."""

    def __init__(self, shard: TensorShard) -> None:
        self.rank = shard.rank
        self.start, self.end = shard.vocab_range()
        self.widths = [b - a for a, b in (shard.vocab_range(r) for r in range(shard.world))]

    def embed(self, input_ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """Every token's embedding row [T, H] (``weight``: this rank's rows)."""
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.end - self.start)
        x = F.embedding(local.masked_fill(outside, 0), weight)
        x.masked_fill_(outside[:, None], 0)
        return group.all_reduce(x)

    def logits(self, hidden: torch.Tensor, lm_head) -> torch.Tensor | None:
        """The logits [B, vocab] float32 on rank 0 (None on the others), from each rank's
        ``lm_head`` rows."""
        return group.gather_columns(lm_head(hidden).float(), self.widths)


def rank_parts(tensor_parallel: tuple[int, int] | None, dims: ModelDims):
    """What a model loaded as ``tensor_parallel`` = (rank, world) needs: its
    :class:`TensorShard` (None: the whole model), the dimensions it computes with, the
    all-reduce of its row-parallel outputs and its :class:`VocabParallel` (None for both in
    one process)."""
    if tensor_parallel is None:
        return None, dims, None, None
    shard = TensorShard(*tensor_parallel, dims)
    if shard.world == 1:
        return shard, shard.local_dims, None, None
    return shard, shard.local_dims, group.all_reduce, VocabParallel(shard)
