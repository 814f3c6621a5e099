"""A Triton grouped GEMM for the MoE experts (CUDA): the expert-sorted rows of one projection
in one launch.

``grouped_matmul(x, w, counts)``: x [M, K] rows sorted by expert (``counts[e]`` rows for
expert e, in order), w [E, N, K] the stacked expert weights (a checkpoint's fused 3-D layout),
out [M, N] with ``out[j] = x[j] @ w[e(j)].T``. The host cuts each expert's run into
``BLOCK_M``-row blocks (a block never spans two experts) and the grid is (blocks, N tiles):
every program reads its expert's weight tile once per K step, as vLLM's fused-MoE kernel
does after its block alignment, with no padding copy of x. Tested on the CPU under
``TRITON_INTERPRET=1`` (fp32/fp16; the interpreter gets bf16 ``tl.dot`` wrong); timed only
on a GPU. The triton import is guarded (``HAS_TRITON``).
"""

from __future__ import annotations

import torch

from loramux.engine.model.triton_import import HAS_TRITON, tl, triton

__all__ = ["HAS_TRITON", "grouped_matmul"]

BLOCK_M = 16

if HAS_TRITON:

    @triton.jit
    def _grouped_gemm(x_ptr, w_ptr, y_ptr, blk_expert_ptr, blk_row_ptr, blk_end_ptr, N, K,
                      stride_xm, stride_we, stride_wn, stride_ym,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      DOT_PRECISION: tl.constexpr):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        e = tl.load(blk_expert_ptr + pid_m).to(tl.int64)
        row0 = tl.load(blk_row_ptr + pid_m)
        end = tl.load(blk_end_ptr + pid_m)
        rows = row0 + tl.arange(0, BLOCK_M)
        rmask = rows < end
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        cmask = cols < N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            kmask = ks < K
            a = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_xm + ks[None, :],
                        mask=rmask[:, None] & kmask[None, :], other=0.0)
            b = tl.load(w_ptr + e * stride_we + cols[None, :].to(tl.int64) * stride_wn + ks[:, None],
                        mask=kmask[:, None] & cmask[None, :], other=0.0)
            acc += tl.dot(a, b, input_precision=DOT_PRECISION)
        out = y_ptr + rows[:, None].to(tl.int64) * stride_ym + cols[None, :]
        tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=rmask[:, None] & cmask[None, :])


def _blocks(counts: list[int], device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per ``BLOCK_M``-row block of the expert-sorted rows: its expert, first row, run end."""
    experts, starts, ends = [], [], []
    start = 0
    for e, c in enumerate(counts):
        for r in range(start, start + c, BLOCK_M):
            experts.append(e)
            starts.append(r)
            ends.append(start + c)
        start += c
    t = torch.tensor([experts, starts, ends], dtype=torch.int32).to(device)
    return t[0], t[1], t[2]


def grouped_matmul(x: torch.Tensor, w: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """``out[j] = x[j] @ w[e(j)].T`` for rows x [M, K] sorted by expert (``counts``), w [E, N, K]."""
    if not HAS_TRITON:
        raise RuntimeError("the Triton MoE path needs the triton package")
    m, k = x.shape
    e, n, k_w = w.shape
    if k_w != k or len(counts) != e or sum(counts) != m:
        raise ValueError(f"grouped_matmul: x {list(x.shape)}, w {list(w.shape)}, {sum(counts)} rows in counts")
    x = x.contiguous()
    w = w.contiguous()
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    blk_expert, blk_row, blk_end = _blocks(counts, x.device)
    block_n = min(64, max(16, triton.next_power_of_2(n)))
    block_k = min(64, max(16, triton.next_power_of_2(k)))
    grid = (blk_expert.numel(), triton.cdiv(n, block_n))
    _grouped_gemm[grid](x, w, y, blk_expert, blk_row, blk_end, n, k, x.stride(0), w.stride(0), w.stride(1),
                        y.stride(0), BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k,
                        DOT_PRECISION="ieee" if x.dtype == torch.float32 else None)  # fp32: no TF32
    return y
