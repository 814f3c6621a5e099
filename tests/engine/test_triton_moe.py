"""The Triton grouped GEMM of the MoE experts (``engine/model/triton_moe.py``, the CUDA path)
against the per-expert definition, under ``TRITON_INTERPRET=1`` on the CPU (fp32 / fp16; the
interpreter gets bf16 ``tl.dot`` wrong): experts with no rows, runs longer than a block,
sizes that are no multiple of the tiles; and a whole MoE block on it equals the torch one."""

from __future__ import annotations

import pytest
import torch

from loramux.engine.model.triton_moe import HAS_TRITON, grouped_matmul

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("counts", [[3, 0, 21, 1], [0, 0, 40, 0], [1, 1, 1, 1, 1, 1]])
def test_grouped_matmul_equals_each_expert_matmul(dtype, counts):
    g = torch.Generator().manual_seed(len(counts))
    e, n, k = len(counts), 40, 24
    x = torch.randn(sum(counts), k, generator=g).to(dtype)
    w = torch.randn(e, n, k, generator=g).to(dtype)
    got = grouped_matmul(x, w, counts)
    rows = torch.repeat_interleave(torch.arange(e), torch.tensor(counts))
    want = torch.einsum("mk,mnk->mn", x.double(), w.double()[rows])
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    assert torch.allclose(got.double(), want, atol=tol * k, rtol=tol)


def test_moe_block_on_triton_equals_torch():
    from loramux.engine.model.moe import MoEBlock

    g = torch.Generator().manual_seed(0)
    e, h, i, t = 6, 32, 20, 37
    router, gate_up, down = (torch.randn(e, h, generator=g), torch.randn(e, 2 * i, h, generator=g) * 0.2,
                             torch.randn(e, h, i, generator=g) * 0.2)

    def silu_mul(gu):
        a, b = gu.chunk(2, dim=-1)
        return torch.nn.functional.silu(a) * b

    x = torch.randn(t, h, generator=g)
    outs = [MoEBlock(router, gate_up, down, 2, True, silu_mul, weights_in_float=False, backend=b)(x, 0, None)
            for b in ("torch", "triton")]
    assert outs[0].abs().sum() > 0
    assert torch.allclose(outs[0], outs[1], atol=1e-4)
