"""vLLM's ``fully_sharded_loras`` under tensor parallelism: the S-LoRA layout.

By default an adapter follows its projection's split (``distributed/shard.py``): on a
column-parallel group (q|k|v, gate|up) every rank holds A whole and B's rows of its outputs; on
a row-parallel one (o, down) A's columns of its inputs and B whole. Fully sharded, each rank
also holds only its share of the rest:

- **column-parallel**: A's rank rows ``[rank·R/N, (rank+1)·R/N)`` of the slot's padded rank
  ``R`` (``max_lora_rank``). The shrink gives each rank ``R/N`` columns of ``x Aᵀ``; one
  all-gather (an all-reduce of each rank's part in its own row) joins them before the expand
  with B's rows of its outputs.
- **row-parallel**: B's output columns ``[rank·H/N, (rank+1)·H/N)``. The ranks' partial
  shrinks (each over its input columns) are summed by one all-reduce of ``x Aᵀ``. Each rank
  then adds ``v Bᵀ`` for its share of the output columns into its partial output, and the
  projection's own all-reduce completes every column.

Each rank's slots hold ``1/N`` of an adapter's A and B where the default holds ``1/N`` of one of
them, at the price of one small collective per LoRA group and layer (``[tokens, R]``
floats). The GEMMs run per run of one adapter's tokens on the block-diagonal slots (A
pre-scaled), so every row's numbers stay its own adapter's.
"""

from __future__ import annotations

import torch

from loramux.adapters.arch import PROJECTION_GROUPS
from loramux.engine.distributed import group as collective

COLUMN_GROUPS = frozenset({"qkv", "gate_up"})
ROW_GROUPS = frozenset({"o", "down"})


class SlotLayout:
    """Each projection group's slot shapes on this rank: A's rank rows and B's output columns
    (the default layout, or the fully sharded one when given the rank's ``TensorShard``)."""

    def __init__(self, dims, max_rank: int, shard=None) -> None:
        self.rank_share: int | None = None
        """A's rank rows per rank on column-parallel groups (None: not fully sharded)."""
        self.a_rows = {g: max_rank for g in PROJECTION_GROUPS}
        self.b_offsets: dict[str, list[int]] = dims.group_offsets()
        """Per group, the slices' offsets in the slots' B columns."""
        self.out_start: dict[str, int] = {}
        """Row-parallel groups, fully sharded: the first output column this rank's B holds."""
        if shard is None:
            return
        world = shard.world
        if max_rank % world:
            raise ValueError(f"fully_sharded_loras splits each adapter's rank over the ranks: "
                             f"max_lora_rank {max_rank} is not divisible by tensor_parallel_size {world}")
        self.rank_share = max_rank // world
        for group in COLUMN_GROUPS:
            self.a_rows[group] = self.rank_share
        for group in (g for g in PROJECTION_GROUPS if g in ROW_GROUPS):  # o before down
            n = self.b_offsets[group][-1]
            if n % world:
                raise ValueError(f"fully_sharded_loras splits {group}'s {n} output columns over the "
                                 f"ranks: not divisible by tensor_parallel_size {world}")
            self.b_offsets[group] = [0, n // world]
            self.out_start[group] = shard.rank * (n // world)


def add_column(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, runs, shard) -> None:
    """A column-parallel group, fully sharded: ``a`` [slots, S, R/N, K] (this rank's rank rows,
    pre-scaled), ``b`` [slots, S·R, n] block-diagonal with this rank's output columns."""
    num_slices, share, k = a.shape[1:]
    world = shard.world
    parts = torch.zeros(world, x.shape[0], num_slices * share, dtype=torch.float32, device=x.device)
    mine = parts[shard.rank]
    for start, end, slot in runs:
        mine[start:end] = torch.mm(_as(x[start:end], a), a[slot].view(num_slices * share, k).t())
    collective.all_reduce(parts)  # every rank's part in its own row: an all-gather
    v = parts.view(world, -1, num_slices, share).permute(1, 2, 0, 3).reshape(x.shape[0], -1)  # [T, S·R]
    _expand(y, v, b, runs)


def add_row(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, runs, out_start: int) -> None:
    """A row-parallel group, fully sharded: ``a`` [slots, S, R, K] (this rank's input columns,
    pre-scaled), ``b`` [slots, S·R, n] this rank's output columns from ``out_start``."""
    num_slices, rank, k = a.shape[1:]
    v = torch.zeros(x.shape[0], num_slices * rank, dtype=torch.float32, device=x.device)
    for start, end, slot in runs:
        v[start:end] = torch.mm(_as(x[start:end], a), a[slot].view(num_slices * rank, k).t())
    collective.all_reduce(v)  # the ranks' partial shrinks over their input columns
    _expand(y.narrow(1, out_start, b.shape[2]), v, b, runs)


def _as(x: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return x if x.dtype == like.dtype else x.to(like.dtype)


def _expand(y: torch.Tensor, v: torch.Tensor, b: torch.Tensor, runs) -> None:
    """``y[run] += v[run] @ B[slot]`` per run, in the slots' dtype, accumulated in y's."""
    for start, end, slot in runs:
        vs, bs, ys = _as(v[start:end], b), b[slot], y[start:end]
        if ys.dtype == bs.dtype:
            ys.addmm_(vs, bs)
        else:
            ys.add_(torch.mm(vs, bs))
