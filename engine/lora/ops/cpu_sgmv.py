"""Multi-LoRA on the CPU through the SGMV operator (``torch.ops.loramux.lora_sgmv``,
``engine/model/csrc/lora_sgmv.c``).

The runs of a step's tokens that share an adapter slot and are short (decode rows, small
prompt chunks) go through one kernel call per projection group, reading each slot's A and
B in place and only as many rows as the adapter's rank; long runs (prompt chunks) go to
GEMMs on the adapter's rank (``torch_ops._add_runs_ranked``), where oneDNN's blocking wins. Slots are pre-scaled and block-diagonal (the
torch backend's layout, ``SlotBuffers``).
"""

from __future__ import annotations

import torch

from loramux.engine.lora.meta import LoRABatchMeta
from loramux.engine.model.kernels import loader
from loramux.engine.model.kernels import ops as kernels

# Runs of at most this many tokens go through the kernel; longer runs through GEMMs on the
# adapter's rank (``torch_ops._add_runs_ranked``: per token the kernel runs at ~1/2 a GEMM's
# FLOP rate; measured at 64-token runs the kernel is 0.9-2.2x the rank-only GEMMs, at
# 300-token runs 0.6-1.25x).
SGMV_MAX_RUN = 64

_FLOATS = (torch.float32, torch.bfloat16)


def usable(x: torch.Tensor, a_stack: torch.Tensor, b_blockdiag: torch.Tensor, y: torch.Tensor) -> bool:
    """Whether these tensors fit the kernel (CPU, fp32/bf16, dense rows and slots) and the
    compiled kernels are loaded and on. Asked at every CPU LoRA layer call."""
    return (
        x.dtype in _FLOATS and y.dtype in _FLOATS and a_stack.dtype in _FLOATS
        and a_stack.dtype == b_blockdiag.dtype and x.device.type == "cpu"
        and x.stride(1) == 1 and y.stride(1) == 1
        and a_stack.is_contiguous() and b_blockdiag.is_contiguous()
        and loader.available()
    )


def split_runs(meta: LoRABatchMeta) -> tuple[torch.Tensor, list[tuple[int, int, int]], list[int]]:
    """(the short runs as the kernel's table, the long runs left to GEMMs, the slots' ranks)
    of the step: computed once per step (memo on ``meta``), read by every LoRA layer."""
    if meta.cpu_split is None:
        short = [r for r in meta.runs if r[1] - r[0] <= SGMV_MAX_RUN]
        if len(short) == len(meta.runs) and meta.run_table is not None:
            table = meta.run_table
        else:
            table = torch.tensor(short, dtype=torch.int64).reshape(-1, 3)
        long = [r for r in meta.runs if r[1] - r[0] > SGMV_MAX_RUN]
        meta.cpu_split = (table, long, meta.slot_ranks.tolist())
    return meta.cpu_split


_offsets_cache: dict[tuple[int, ...], torch.Tensor] = {}


def _offsets(slice_offsets) -> torch.Tensor:
    """``slice_offsets`` as the kernel's int64 tensor (made once per value; the operator checks it)."""
    key = tuple(map(int, slice_offsets))
    t = _offsets_cache.get(key)
    if t is None:
        t = _offsets_cache[key] = torch.tensor(key, dtype=torch.int64)
    return t


def add_runs_sgmv(
    y: torch.Tensor, x: torch.Tensor, a_stack: torch.Tensor, b_blockdiag: torch.Tensor,
    runs: torch.Tensor, slot_ranks: torch.Tensor, slice_offsets,
) -> None:
    """``y[t] += (x[t] @ A[slot].T) @ B[slot]`` for every token of ``runs`` ([n, 3] int64:
    start, end, slot); A ``[slots, S, R, K]`` pre-scaled, B ``[slots, S * R, N]`` with slice
    ``s`` in rows ``s*R..`` and columns ``slice_offsets[s]..slice_offsets[s+1]`` only."""
    if runs.shape[0] == 0:
        return
    ranks = slot_ranks if slot_ranks.dtype == torch.int64 and slot_ranks.is_contiguous() else (
        slot_ranks.to(torch.int64).contiguous())
    kernels.lora_sgmv(y, x, a_stack, b_blockdiag, runs, ranks, _offsets(slice_offsets))
