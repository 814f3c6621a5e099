"""Multi-LoRA on the CPU through the SGMV operator (``torch.ops.loramux.lora_sgmv``,
``engine/model/csrc/lora_sgmv.c``).

The runs of a step's tokens that share an adapter slot and are short for their rank (decode
rows, prompt chunks of low-rank adapters: :func:`max_kernel_run`) go through one kernel call per projection group, reading each slot's A and
B in place and only as many rows as the adapter's rank; long runs (prompt chunks) go to
GEMMs on the adapter's rank (``torch_ops._add_runs_ranked``), where oneDNN's blocking wins. Slots are pre-scaled and block-diagonal (the
torch backend's layout, ``SlotBuffers``).
"""

from __future__ import annotations

import functools

import torch

from loramux.engine.lora.meta import LoRABatchMeta
from loramux.engine.model.kernels import loader
from loramux.engine.model.kernels import ops as kernels

# Runs of at most this many tokens go through the kernel, by the slot's rank and dtype; longer
# runs through GEMMs on the adapter's rank (``torch_ops._add_runs_ranked``). The GEMMs' cost
# hardly grows with the run (y's traffic and the GEMM library's fixed cost per call dominate:
# ~25 us a bf16 oneDNN call, ~6 us an fp32 one, seven calls a layer) while the kernel's grows
# with run and rank, so low ranks stay in the kernel for longer runs. Measured with 2 threads
# (the kernel splits calls from PARALLEL_MIN_MACS in lora_sgmv.c), kernel time / GEMM time over
# the default model's 4 groups, on a 2-core AVX-512-BF16 EPYC: bf16 slots (the avx512bf16
# variant) rank 8 0.69 at 256, 0.88 at 384; rank 16 0.88 at 192, 1.09 at 256; rank 32 0.91 at
# 96, 1.09 at 128. fp32 slots (the avx2 variant): rank 8 0.95 at 256, 1.10 at 384; rank 16 0.96
# at 128, 1.05 at 160; rank 32 1.03 at 24.
SGMV_MAX_RUN_BY_RANK = {
    torch.float32: ((8, 320), (16, 128), (32, 24)),
    torch.bfloat16: ((8, 384), (16, 224), (32, 112)),
}
# bf16 slots on the kernel's native-bf16 variant (VDPBF16PS) where oneDNN has no AMX tiles: in a
# whole engine step (bench/sgmv_runs.py: a prompt run beside 8 decode rows of 4 adapters, slots of
# rank 32, the default model, 2 threads, each step replayed with the kernel and with the GEMMs
# alternately: the adapters' time beside the same step without them) the kernel cost less than the
# GEMMs at every length measured up to 1000 tokens and rank up to 32 (2-core AVX-512-BF16 EPYC,
# 2026-12-07, kernel against GEMMs: ranks 8/16/32 at 160 tokens 12/15/18 against 32/33/41 ms, at
# 512 32/43/63 against 54/56/70, at 1000 79/73/121 against 84/74/147). The table above holds in
# isolated calls of hot weights, where the GEMMs gain most; a step's adapter weights and y come
# from beyond the caches. With AMX, oneDNN's bf16 GEMMs are several times faster and the table
# above stays.
SGMV_MAX_RUN_NATIVE_BF16 = ((32, 1024),)
SGMV_MAX_RUN_HIGH_RANK = 16  # ranks above the table's last


def run_table(w_dtype: torch.dtype) -> tuple[tuple[int, int], ...]:
    """(rank, longest kernel run) pairs for slots in ``w_dtype`` on this CPU and kernel variant."""
    if w_dtype == torch.bfloat16 and _native_bf16_without_amx():
        return SGMV_MAX_RUN_NATIVE_BF16
    return SGMV_MAX_RUN_BY_RANK[w_dtype]


@functools.cache
def _cpu_has_amx() -> bool:
    return bool(torch.cpu.get_capabilities().get("amx_bf16"))


def _native_bf16_without_amx() -> bool:
    return loader.available() and torch.ops.loramux.isa() == "avx512bf16" and not _cpu_has_amx()


def max_kernel_run(rank: int, w_dtype: torch.dtype = torch.float32, table=None) -> int:
    """The longest run of one adapter of ``rank`` (slots in ``w_dtype``) that the kernel takes
    (longer: GEMMs); ``table``: :func:`run_table`'s, when the caller has it."""
    for top, length in table or run_table(w_dtype):
        if rank <= top:
            return length
    return SGMV_MAX_RUN_HIGH_RANK


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


def split_runs(
    meta: LoRABatchMeta, w_dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, list[tuple[int, int, int]], list[int]]:
    """(the short runs as the kernel's table, the long runs left to GEMMs, the slots' ranks)
    of the step, slots in ``w_dtype``: computed once per step (memo on ``meta``; a step's slots
    have one dtype), read by every LoRA layer."""
    if meta.cpu_split is None:
        ranks = meta.slot_ranks.tolist()
        limits = run_table(w_dtype)
        top = [max_kernel_run(r, w_dtype, limits) for r in ranks]
        short = [r for r in meta.runs if r[1] - r[0] <= top[r[2]]]
        if len(short) == len(meta.runs) and meta.run_table is not None:
            table = meta.run_table
        else:
            table = torch.tensor(short, dtype=torch.int64).reshape(-1, 3)
        long = [r for r in meta.runs if r[1] - r[0] > top[r[2]]]
        meta.cpu_split = (table, long, ranks)
    return meta.cpu_split


_offsets_cache: dict[tuple[int, ...], torch.Tensor] = {}


def offsets_tensor(slice_offsets) -> torch.Tensor:
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
    kernels.lora_sgmv(y, x, a_stack, b_blockdiag, runs, ranks, offsets_tensor(slice_offsets))
