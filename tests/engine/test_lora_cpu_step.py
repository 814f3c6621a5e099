"""The CPU LoRA hot path: one step's SGMV calls laid out at prepare (``cpu_step.SgmvStep``)
and read by every layer call of ``LoRAStepBatch``, against a dense reference and against the
general path it stands in for (kernels off, strided activations)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from support.cpu_kernel import require_cpu_kernel

from loramux.engine.lora.norms import NormSlots
from loramux.engine.lora.ops import cpu_step
from loramux.engine.lora.ops.cpu_sgmv import max_kernel_run
from loramux.engine.lora.step import LoRAStepBatch
from loramux.engine.lora.vocab import VocabSlots

R = 8
RANKS = [8, 3, 5]
GROUPS = {"qkv": (24, (16, 8, 8)), "down": (40, (24,))}


def make_buffers(seed: int = 0, layers: int = 2):
    """Duck-typed SlotBuffers (torch backend layout): A pre-scaled [slots, S, R, K], B
    block-diagonal [slots, S * R, N], rows past each slot's rank zero."""
    g = torch.Generator().manual_seed(seed)
    a_layers, b_layers, offsets = [], [], {}
    for _ in range(layers):
        a_l, b_l = {}, {}
        for group, (k, widths) in GROUPS.items():
            offs = [0]
            for w in widths:
                offs.append(offs[-1] + w)
            offsets[group] = offs
            S = len(widths)
            a = torch.zeros(len(RANKS), S, R, k)
            b = torch.zeros(len(RANKS), S * R, offs[-1])
            for slot, r in enumerate(RANKS):
                a[slot, :, :r] = torch.randn(S, r, k, generator=g) * 0.3
                for s in range(S):
                    b[slot, s * R : s * R + r, offs[s] : offs[s + 1]] = torch.randn(r, widths[s], generator=g) * 0.3
            a_l[group], b_l[group] = a, b
        a_layers.append(a_l)
        b_layers.append(b_l)
    return SimpleNamespace(blockdiag=True, scale=None, ranks=torch.tensor(RANKS), a=a_layers, b=b_layers,
                           slice_offsets=offsets, experts=None, dora=[frozenset()] * len(RANKS),
                           vocab=VocabSlots(torch.float32, "cpu", False, 64, 64),  # no vocab parts
                           norms=NormSlots(torch.float32, "cpu"))  # no module copies


def dense(y, x, a, b, token_slots):
    """y + x @ A[slot].T @ B[slot] per token (fp32), the tokens without an adapter as they are."""
    out = y.float().clone()
    S, k = a.shape[1], a.shape[3]
    for t, slot in enumerate(token_slots):
        if slot >= 0:
            out[t] += (x[t].float() @ a[slot].reshape(S * R, k).t()) @ b[slot]
    return out


# decode rows over the three slots and a base row, then a prompt chunk on slot 1 (the kernel
# takes it: short for rank 3) and one on slot 2 longer than the kernel takes for rank 5 (GEMMs)
ROW_SLOTS = [0, 0, 1, 2, -1, 1, 2]
ROW_TOKENS = [1, 1, 1, 1, 1, 40, max_kernel_run(5) + 10]


def step_tokens() -> list[int]:
    return [s for s, n in zip(ROW_SLOTS, ROW_TOKENS, strict=True) for _ in range(n)]


def run_step(hook: LoRAStepBatch, buffers, x_dtype, strided: bool = False):
    g = torch.Generator().manual_seed(7)
    hook.prepare(frozenset({"a", "b", "c"}), ROW_SLOTS, ROW_TOKENS, frozenset(GROUPS))
    T = sum(ROW_TOKENS)
    results = []
    for layer in range(len(buffers.a)):
        for group, (k, widths) in GROUPS.items():
            x = torch.randn(T, 2 * k if strided else k, generator=g).to(x_dtype)
            if strided:
                x = x[:, ::2]  # rows of x not dense: the kernel cannot read them
            y = torch.randn(T, sum(widths), generator=g).to(x_dtype)
            expected = dense(y, x, buffers.a[layer][group], buffers.b[layer][group], step_tokens())
            hook.add(layer, group, x, y)
            results.append((y, expected))
    return results


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_step_calls_match_dense_reference(x_dtype):
    require_cpu_kernel()
    buffers = make_buffers()
    hook = LoRAStepBatch(buffers, "torch", torch.device("cpu"))
    results = run_step(hook, buffers, x_dtype)
    assert isinstance(hook._sgmv, cpu_step.SgmvStep)
    assert hook._sgmv.long and hook._sgmv.table.shape[0] == 4  # both paths ran in the step
    tol = 1e-4 if x_dtype == torch.float32 else 5e-2
    for y, expected in results:
        torch.testing.assert_close(y.float(), expected, rtol=tol, atol=tol)
    hook.clear()
    assert hook._sgmv is None


def test_general_path_without_kernels_and_for_strided_rows(monkeypatch):
    """Kernels off (LORAMUX_CPU_KERNELS=0): no per-step kernel calls, the same results through
    the general path; strided x rows: the step's calls decline and the general path runs."""
    require_cpu_kernel()
    buffers = make_buffers(seed=1)
    hook = LoRAStepBatch(buffers, "torch", torch.device("cpu"))
    for y, expected in run_step(hook, buffers, torch.float32, strided=True):
        torch.testing.assert_close(y, expected, rtol=1e-4, atol=1e-4)
    assert hook._sgmv is not None
    monkeypatch.setenv("LORAMUX_CPU_KERNELS", "0")
    for y, expected in run_step(hook, buffers, torch.float32):
        torch.testing.assert_close(y, expected, rtol=1e-4, atol=1e-4)
    assert hook._sgmv is None


def test_declines_without_touching_y():
    require_cpu_kernel()
    buffers = make_buffers(seed=2, layers=1)
    hook = LoRAStepBatch(buffers, "torch", torch.device("cpu"))
    hook.prepare(frozenset({"a"}), [0, 1], [1, 1], frozenset(GROUPS))
    k, widths = GROUPS["down"]
    y = torch.randn(2, sum(widths))
    before = y.clone()
    x = torch.randn(2, 2 * k)[:, ::2]
    assert not hook._sgmv.add("down", y, x, buffers.a[0]["down"], buffers.b[0]["down"])
    assert not hook._sgmv.add("down", y.half(), x.contiguous(), buffers.a[0]["down"], buffers.b[0]["down"])
    assert torch.equal(y, before)


def test_slots_fit_refuses_what_the_kernel_cannot_read():
    buffers = make_buffers(seed=3, layers=1)
    assert cpu_step.slots_fit(buffers.a, buffers.b)
    half = [{g: t.half() for g, t in layer.items()} for layer in buffers.a]
    assert not cpu_step.slots_fit(half, buffers.b)
    strided = [{g: t.transpose(2, 3) for g, t in layer.items()} for layer in buffers.a]
    assert not cpu_step.slots_fit(strided, buffers.b)
    hook = LoRAStepBatch(SimpleNamespace(**{**vars(buffers), "a": half}), "torch", torch.device("cpu"))
    assert not hook._cpu_sgmv
