"""DoRA's per-row scale on a step's output (``engine/lora/dora.py``): the slice, span (gathered
per projection or once per step) and Triton (interpreted without a GPU) paths all give ``g ⊙ y + c`` on the DoRA rows of the
step and leave every other row alone."""

from __future__ import annotations

import pytest
import torch

from loramux.engine.lora.dora import DoraStep


class _Buffers:
    """The fields DoraStep reads of ``SlotBuffers``."""

    def __init__(self, n: int, dtype: torch.dtype, shift: bool) -> None:
        g = torch.Generator().manual_seed(0)
        self.max_loras = 3
        gain = torch.randn(4, n, generator=g) * 0.1
        gain[3] = 0  # the zero row
        self.row_gain_stack = {"qkv": gain.to(dtype)[None]}  # one layer
        self.row_gain = [{"qkv": self.row_gain_stack["qkv"][0]}]
        self.row_shift = {(0, "qkv"): (torch.randn(4, n, generator=g) * 0.1).to(dtype)} if shift else {}
        if shift:
            self.row_shift[(0, "qkv")][3] = 0
        self.dora = [frozenset({(0, "qkv")}), frozenset(), frozenset({(0, "qkv")})]


@pytest.mark.parametrize("mode", ["slices", "span", "pregathered", "triton"])
@pytest.mark.parametrize("shift", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_dora_rows_scaled_others_untouched(mode, shift, dtype, monkeypatch):
    if mode == "triton":
        pytest.importorskip("triton")
    monkeypatch.setattr("loramux.engine.lora.dora.SLICE_RUNS", 100 if mode == "slices" else 0)
    monkeypatch.setattr("loramux.engine.lora.dora.PREGATHER_TOKENS", 1000 if mode == "pregathered" else 0)
    n = 300  # not a multiple of the kernel's block
    bufs = _Buffers(n, dtype, shift)
    # tokens: slot 0 [0, 3), base [3, 5), a long prefill run of slot 2 [5, 25), slot 1 (plain
    # LoRA) [25, 27), slot 0 [27, 28), slot 2 [28, 30): the long run is a slice, the rest a span
    runs = [(0, 3, 0), (5, 25, 2), (27, 28, 0), (28, 30, 2)]
    y = torch.randn(30, n, generator=torch.Generator().manual_seed(1)).to(dtype)
    want = y.float().clone()
    for start, end, slot in runs:
        want[start:end] = want[start:end] * (1 + bufs.row_gain[0]["qkv"][slot].float())
        if shift:
            want[start:end] += bufs.row_shift[(0, "qkv")][slot].float()
    step = DoraStep(runs, bufs, "cpu", triton=mode == "triton")
    step.apply(0, "o", y)  # a group no slot scales: nothing
    before = y.clone()
    step.apply(0, "qkv", y)
    tol = 1e-6 if dtype == torch.float32 else 2e-3
    assert torch.allclose(y.float(), want, atol=tol, rtol=tol)
    for start, end in ((3, 5), (25, 27)):
        assert torch.equal(y[start:end], before[start:end])
    assert not torch.equal(y[0:3], before[0:3])


@pytest.mark.parametrize("pack", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_row_norms_and_projection_of_a(pack, dtype, monkeypatch):
    """What DoRA reads of a base projection: its rows' norms and ``A @ W.T`` (no bias), from
    a packed weight too, and in bounded chunks of an unpacked bf16 one."""
    from loramux.engine.model.linear import Linear

    monkeypatch.setattr("loramux.engine.model.linear._PROJECT_CHUNK_ELEMS", 100)  # 6 rows a chunk
    g = torch.Generator().manual_seed(0)
    w = torch.randn(37, 16, generator=g).to(dtype)
    lin = Linear(w, torch.randn(37, generator=g).to(dtype), pack=pack)
    a = torch.randn(3, 16, generator=g)
    # a packed bf16 GEMM (CPUs with bf16 matmuls) rounds its output to bf16
    rounded = lin.packed and lin.compute_dtype == torch.bfloat16
    assert torch.allclose(lin.project(a), a @ w.float().T, atol=5e-2 if rounded else 1e-4,
                          rtol=1e-2 if rounded else 1e-4)
    assert torch.allclose(lin.row_norms(), w.float().norm(dim=1), rtol=1e-6)
