"""LoRA shrink/expand kernels: torch fast path, per-segment reference, dense per-token math,
and the Triton kernels (under TRITON_INTERPRET=1 when there is no GPU)."""

from __future__ import annotations

import os
import random

import pytest
import torch
from support.cpu_kernel import ISAS, forced_isa, require_cpu_kernel
from support.lora_reference import reference_expand, reference_shrink
from support.services import IN_CI

from loramux.engine.lora import ops
from loramux.engine.lora.meta import LoRABatchMeta
from loramux.engine.lora.ops import torch_ops, triton_ops

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


# ---------------------------------------------------------------------------- helpers


def make_slots(seg_spec: list[tuple[int, int]], n_none: int, seed: int) -> list[int]:
    """Token slots from (slot, n_tokens) pairs plus ``n_none`` -1 tokens, shuffled."""
    slots = [s for s, n in seg_spec for _ in range(n)] + [-1] * n_none
    random.Random(seed).shuffle(slots)
    return slots


def make_weights(ranks, num_slices, K, widths, dtype, seed, device="cpu"):
    """a_stack [slots, slices, R, K], b_stack [slots, N, R] with zeros beyond each rank."""
    g = torch.Generator().manual_seed(seed)
    R = max(max(ranks), 1)
    n = len(ranks)
    a = torch.randn(n, num_slices, R, K, generator=g) / K**0.5
    b = torch.randn(n, sum(widths), R, generator=g) / R**0.5
    for i, r in enumerate(ranks):
        a[i, :, r:] = 0
        b[i, :, r:] = 0
    scale = 0.5 + torch.rand(n, generator=g)
    return a.to(device, dtype), b.to(device, dtype), scale.to(device)


def offsets(widths):
    out = [0]
    for w in widths:
        out.append(out[-1] + w)
    return out


def dense_delta(x, a, b, slots, ranks, scale, offs) -> torch.Tensor:
    """Per-token LoRA delta in fp64 with each token's own A/B (no segments at all)."""
    T = x.shape[0]
    delta = torch.zeros(T, b.shape[1], dtype=torch.float64, device=x.device)
    for t, slot in enumerate(slots):
        if slot < 0 or ranks[slot] == 0:
            continue
        for s in range(a.shape[1]):
            lo, hi = offs[s], offs[s + 1]
            v = float(scale[slot]) * torch.einsum("rk,k->r", a[slot, s].double(), x[t].double())
            delta[t, lo:hi] = torch.einsum("nr,r->n", b[slot, lo:hi].double(), v)
    return delta


# Layouts: (name, [(slot, n_tokens)...], n_none, ranks per slot)
LAYOUTS = {
    "decode_32_adapters": ([(i, 1) for i in range(32)], 3, [1 + (i * 7) % 64 for i in range(32)]),
    "prefill_one_adapter": ([(0, 40)], 0, [16]),
    "prefill_80_tokens_gathered": ([(1, 80)], 5, [4, 16]),  # 1 chunk, > 64 rows: 16-bit mm
    "mixed_long_short": ([(2, 100), (0, 1), (5, 1), (3, 7), (1, 2)], 6, [8, 4, 16, 1, 0, 64]),
    "rank0_and_none": ([(0, 3), (1, 5)], 4, [0, 8]),
    "all_none": ([], 5, [4, 8]),
}


# ---------------------------------------------------------------------------- meta


def test_meta_segments_are_stable_sorted_and_drop_rank0():
    slots = [2, -1, 0, 2, 1, 0, -1, 2]
    meta = LoRABatchMeta.build(slots, torch.tensor([4, 0, 8]))
    assert meta.num_tokens == 8
    assert meta.sorted_token_idx.tolist() == [2, 5, 4, 0, 3, 7]
    assert meta.seg_slots.tolist() == [0, 2]  # slot 1 has rank 0: no segment
    assert meta.seg_starts.tolist() == [0, 3]
    assert meta.seg_lens.tolist() == [2, 3]
    assert meta.max_seg_len == 3
    assert meta.num_lora_tokens == 6
    assert meta.has_lora
    assert not meta.identity_layout and not meta.identity_tokens


def test_meta_has_lora_false():
    assert not LoRABatchMeta.build([-1, -1], torch.tensor([4])).has_lora
    assert not LoRABatchMeta.build([0, 0, -1], torch.tensor([0, 3])).has_lora
    empty = LoRABatchMeta.build([], torch.tensor([4]))
    assert not empty.has_lora and empty.num_tokens == 0


def test_meta_rejects_bad_slots():
    with pytest.raises(ValueError, match="token slots"):
        LoRABatchMeta.build([0, 3], torch.tensor([4, 4]))
    with pytest.raises(ValueError, match="token slots"):
        LoRABatchMeta.build([-2], torch.tensor([4]))


def test_meta_chunk_layout_covers_every_segment_row_once():
    slots = make_slots([(1, 100), (0, 1), (3, 1), (2, 9)], 5, seed=1)
    meta = LoRABatchMeta.build(torch.tensor(slots), torch.tensor([2, 4, 8, 16]))
    C = meta.chunk_len
    assert C < 100  # one long segment must not pad every short one to 100 rows
    pos = meta.chunk_pos.view(-1, C)
    mask = meta.chunk_mask.view(-1, C).bool()
    real = pos[mask]
    assert sorted(real.tolist()) == list(range(meta.num_lora_tokens))
    assert torch.equal(meta.chunk_tokens, meta.sorted_token_idx[meta.chunk_pos])
    assert torch.equal(meta.chunk_pos[meta.chunk_keep], real)
    # every chunk holds rows of one slot only
    slots_t = torch.tensor(slots)
    chunk_tok_slots = slots_t[meta.chunk_tokens].view(-1, C)
    assert torch.equal(chunk_tok_slots, meta.chunk_slots[:, None].expand(-1, C))


def test_meta_identity_flags_and_slot_range():
    meta = LoRABatchMeta.build([3] * 10, torch.tensor([0, 0, 0, 8]))
    assert meta.identity_layout and meta.identity_tokens and meta.chunk_mask is None
    assert meta.chunk_slot_start == 3
    meta = LoRABatchMeta.build([1, 0, 1], torch.tensor([4, 4]))
    assert not meta.identity_tokens and meta.chunk_slot_start == 0
    # LoRA tokens leading the batch in slot order, base-model tokens after them: in place.
    meta = LoRABatchMeta.build([0, 0, 1, 1, -1], torch.tensor([4, 4]))
    assert meta.identity_tokens and meta.num_lora_tokens == 4
    meta = LoRABatchMeta.build([2, 0, 2], torch.tensor([4, 4, 4]))
    assert meta.chunk_slot_start is None  # slots 0 and 2: weights are gathered


# ---------------------------------------------------------------------------- torch backend


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("widths", [(48,), (40, 24), (48, 16, 16)], ids=["1s", "2s", "3s"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_torch_fast_matches_reference_and_dense(layout, widths, dtype):
    spec, n_none, ranks = LAYOUTS[layout]
    slots = make_slots(spec, n_none, seed=len(layout))
    K = 67
    a, b, scale = make_weights(ranks, len(widths), K, widths, dtype, seed=3)
    offs = offsets(widths)
    meta = LoRABatchMeta.build(slots, torch.tensor(ranks))
    g = torch.Generator().manual_seed(5)
    x = torch.randn(len(slots), K, generator=g).to(dtype)
    y0 = torch.randn(len(slots), offs[-1], generator=g).to(dtype)

    v_fast = torch_ops.lora_shrink(x, a, meta, scale)
    v_ref = reference_shrink(x, a, meta, scale)
    assert v_fast.dtype == torch.float32
    assert v_fast.shape == (len(widths), meta.num_lora_tokens, a.shape[2])
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(v_fast, v_ref, **tol)

    y_fast, y_ref = y0.clone(), y0.clone()
    torch_ops.lora_expand(v_fast, b, meta, y_fast, offs)
    reference_expand(v_ref, b, meta, y_ref, offs)
    want = y0.double() + dense_delta(x, a, b, slots, ranks, scale, offs)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=6e-2, rtol=3e-2)
    torch.testing.assert_close(y_ref.double(), want, **tol)
    torch.testing.assert_close(y_fast.double(), want, **tol)

    # rows without an adapter (or with a rank-0 adapter) are bit-for-bit untouched
    y_fused = y0.clone()
    torch_ops.add_lora(y_fused, x, a, b, meta, scale, offs)
    torch.testing.assert_close(y_fused.double(), want, **tol)

    untouched = [t for t, s in enumerate(slots) if s < 0 or ranks[s] == 0]
    assert torch.equal(y_fast[untouched], y0[untouched])
    assert torch.equal(y_fused[untouched], y0[untouched])
    if meta.has_lora:  # the comparison is not vacuous
        touched = [t for t in range(len(slots)) if t not in untouched]
        assert (y_fast[touched].float() - y0[touched].float()).abs().max() > 0.1


def test_add_lora_no_lora_is_noop_and_auto_is_torch_on_cpu():
    a, b, scale = make_weights([4], 1, 16, (8,), torch.float32, seed=0)
    meta = LoRABatchMeta.build([-1, -1, -1], torch.tensor([4]))
    y = torch.randn(3, 8)
    y0 = y.clone()
    ops.add_lora(y, torch.randn(3, 16), a, b, meta, scale, (0, 8))
    assert torch.equal(y, y0)
    assert ops.resolve_backend("auto", "cpu") == "torch"
    assert ops.resolve_backend("torch", "cpu") == "torch"
    with pytest.raises(ValueError, match="unknown LoRA backend"):
        ops.resolve_backend("cuda", "cpu")


def test_add_lora_torch_matches_dense():
    widths = (32, 16, 16)
    ranks = [8, 16, 0]
    slots = make_slots([(0, 5), (1, 9), (2, 2)], 3, seed=2)
    a, b, scale = make_weights(ranks, 3, 40, widths, torch.float32, seed=4)
    x = torch.randn(len(slots), 40)
    y = torch.randn(len(slots), 64)
    want = y.double() + dense_delta(x, a, b, slots, ranks, scale, offsets(widths))
    meta = LoRABatchMeta.build(slots, torch.tensor(ranks))
    ops.add_lora(y, x, a, b, meta, scale, offsets(widths), backend="torch")
    torch.testing.assert_close(y.double(), want, atol=1e-4, rtol=1e-4)


def test_bad_slice_offsets_rejected():
    a, b, scale = make_weights([4], 2, 16, (8, 8), torch.float32, seed=0)
    meta = LoRABatchMeta.build([0, 0], torch.tensor([4]))
    v = torch_ops.lora_shrink(torch.randn(2, 16), a, meta, scale)
    with pytest.raises(ValueError, match="slice_offsets"):
        torch_ops.lora_expand(v, b, meta, torch.zeros(2, 16), (0, 8))


# ---------------------------------------------------------------------------- triton backend


def require_triton() -> None:
    if triton_ops.HAS_TRITON:
        return
    if IN_CI:
        pytest.fail("triton must be importable under CI=true")
    pytest.skip("triton is not installed")


# (name, seg spec, n_none, ranks, slice widths, K)
TRITON_CASES = {
    # one ~100-token segment next to 1-token ones, a rank-0 slot, odd K and N: tl.dot path
    "mixed_3slices": (
        [(2, 100), (0, 1), (5, 1), (3, 7), (4, 3)],
        5,
        [8, 4, 64, 1, 0, 33],
        (67, 33, 17),
        2049,
    ),
    # 32 adapters x 1 token: the non-dot decode path (BLOCK_M = 1)
    "decode_32": (
        [(i, 1) for i in range(32)],
        4,
        [1 + (i * 7) % 64 for i in range(32)],
        (65,),
        2049,
    ),
    # segments of 2-3 tokens: decode path with BLOCK_M = 4, two slices
    "decode_short_2slices": ([(0, 3), (1, 2), (2, 1), (3, 3)], 2, [16, 0, 5, 64], (33, 31), 257),
}


def _triton_case(name, dtype, seed=0):
    spec, n_none, ranks, widths, K = TRITON_CASES[name]
    slots = make_slots(spec, n_none, seed=seed)
    a, b, scale = make_weights(ranks, len(widths), K, widths, dtype, seed=seed + 1, device=DEV)
    g = torch.Generator().manual_seed(seed + 2)
    x = torch.randn(len(slots), K, generator=g).to(DEV, dtype)
    y0 = torch.randn(len(slots), sum(widths), generator=g).to(DEV, dtype)
    meta = LoRABatchMeta.build(slots, torch.tensor(ranks), device=DEV)
    return slots, ranks, a, b, scale, x, y0, meta, offsets(widths)


def _tol(dtype):
    return dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize(
    "name,dtype,deterministic",
    [
        ("mixed_3slices", torch.float32, False),
        ("mixed_3slices", torch.float16, True),
        ("decode_32", torch.float32, True),
        ("decode_32", torch.float16, False),
        ("decode_short_2slices", torch.float32, False),
        ("decode_short_2slices", torch.float16, True),
    ],
)
def test_triton_matches_torch_reference(name, dtype, deterministic):
    require_triton()
    slots, ranks, a, b, scale, x, y0, meta, offs = _triton_case(name, dtype)
    v_ref = reference_shrink(x, a, meta, scale)
    v = ops.lora_shrink(x, a, meta, scale, backend="triton", deterministic=deterministic)
    assert v.dtype == torch.float32 and v.shape == v_ref.shape
    torch.testing.assert_close(v, v_ref, **_tol(dtype))

    y_ref, y = y0.clone(), y0.clone()
    reference_expand(v_ref, b, meta, y_ref, offs)
    ops.lora_expand(v, b, meta, y, offs, backend="triton")
    torch.testing.assert_close(y.float(), y_ref.float(), **_tol(dtype))
    want = y0.double() + dense_delta(x, a, b, slots, ranks, scale, offs)
    torch.testing.assert_close(y.double(), want, **_tol(dtype))

    untouched = [t for t, s in enumerate(slots) if s < 0 or ranks[s] == 0]
    assert untouched and torch.equal(y[untouched], y0[untouched])
    touched = [t for t in range(len(slots)) if t not in untouched]
    assert (y[touched].float() - y0[touched].float()).abs().max() > 0.1


def test_triton_split_k_atomics_match_deterministic():
    require_triton()
    _, _, a, b, scale, x, _, meta, _ = _triton_case("mixed_3slices", torch.float32, seed=7)
    v_det = triton_ops.lora_shrink(x, a, meta, scale, deterministic=True)
    v_split = triton_ops.lora_shrink(x, a, meta, scale, config={"SPLIT_K": 8})
    torch.testing.assert_close(v_split, v_det, atol=1e-5, rtol=1e-5)
    # deterministic=True overrides a requested split-K and is bit-reproducible
    v_det2 = triton_ops.lora_shrink(x, a, meta, scale, deterministic=True, config={"SPLIT_K": 8})
    assert torch.equal(v_det, v_det2)


def test_triton_add_lora_and_paths_chosen_by_max_seg_len():
    require_triton()
    slots, ranks, a, b, scale, x, y0, meta, offs = _triton_case("decode_32", torch.float32, seed=3)
    assert not triton_ops.shrink_config(meta, x.shape[1], a.shape[2], 1, DEV, False)["USE_DOT"]
    meta_long = LoRABatchMeta.build([0] * 20, torch.tensor([4]))
    assert triton_ops.expand_config(meta_long, 4, 64)["USE_DOT"]
    y = y0.clone()
    ops.add_lora(y, x, a, b, meta, scale, offs, backend="triton")
    want = y0.double() + dense_delta(x, a, b, slots, ranks, scale, offs)
    torch.testing.assert_close(y.double(), want, atol=1e-4, rtol=1e-4)


_COMPILE_SCRIPT = r"""
import sys
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from loramux.engine.lora.meta import LoRABatchMeta
from loramux.engine.lora.ops import triton_ops

def compile_(fn, ptrs, consts):
    names = fn.arg_names
    sig = {n: "constexpr" if n in consts else ptrs.get(n, "i32") for n in names}
    cx = {(names.index(n),): v for n, v in consts.items()}
    return triton.compile(ASTSource(fn=fn, signature=sig, constexprs=cx),
                          target=GPUTarget("cuda", 90, 32)).asm["cubin"]

idx = {p: "*i64" for p in ("tok_ptr", "seg_start_ptr", "seg_len_ptr", "seg_slot_ptr", "rank_ptr")}
for seg_len in (64, 1, 3):  # tl.dot path, decode path with BLOCK_M 1 and 4
    meta = LoRABatchMeta.build([0] * seg_len, torch.tensor([16]))
    cfg = triton_ops.shrink_config(meta, 4096, 16, 3, torch.device("cpu"), deterministic=False)
    cfg.update(SPLIT_K=4, DOT_PRECISION=None)
    ptrs = dict(idx, x_ptr="*bf16", a_ptr="*bf16", v_ptr="*fp32", scale_ptr="*fp32")
    assert compile_(triton_ops._shrink_kernel, ptrs, cfg)
    cfg = dict(triton_ops.expand_config(meta, 16, 4096), DOT_PRECISION=None)
    ptrs = dict(idx, v_ptr="*fp32", b_ptr="*bf16", y_ptr="*bf16")
    assert compile_(triton_ops._expand_kernel, ptrs, cfg)
    print("compiled", seg_len, cfg["USE_DOT"])
"""


def test_triton_kernels_compile_for_hopper_bf16():
    """Compile (no launch) both kernels for sm_90 in bf16 -- the GPU serving dtype the
    interpreter cannot check -- in a subprocess without TRITON_INTERPRET (the interpreter
    patches triton.language). Catches lowering errors on machines without a GPU."""
    require_triton()
    import subprocess
    import sys

    import triton

    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    if not os.path.exists(ptxas):
        pytest.skip("this triton build has no bundled ptxas")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    proc = subprocess.run(
        [sys.executable, "-c", _COMPILE_SCRIPT],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("compiled") == 3


@pytest.fixture(params=["sgmv", "torch"])
def cpu_lora_path(request, monkeypatch):
    """Both CPU paths of pre-scaled block-diagonal slots: the SGMV C kernel for short runs
    (where a compiler exists it must build) and the torch GEMMs it falls back to."""
    from loramux.engine.lora.ops import cpu_sgmv

    if request.param == "sgmv":
        require_cpu_kernel()
    else:
        monkeypatch.setattr(cpu_sgmv, "usable", lambda *args: False)
    return request.param


def test_blockdiag_add_matches_reference(cpu_lora_path):
    """The torch engine path (``ops.add_lora`` with the block-diagonal layout): one expand
    GEMM over a block-diagonal B equals the reference."""
    g = torch.Generator().manual_seed(7)
    num_slots, R, K = 4, 8, 40
    widths = [24, 8, 8]
    offs = [0, 24, 32, 40]
    a = torch.randn(num_slots, 3, R, K, generator=g)
    b = torch.randn(num_slots, offs[-1], R, generator=g)
    ranks = torch.tensor([8, 3, 0, 5])
    for slot, r in enumerate(ranks.tolist()):
        a[slot, :, r:] = 0
        b[slot, :, r:] = 0
    bd = torch.zeros(num_slots, 3 * R, offs[-1])
    for s in range(3):
        bd[:, s * R : (s + 1) * R, offs[s] : offs[s + 1]] = b[:, offs[s] : offs[s + 1]].transpose(1, 2)
    scale = torch.tensor([0.5, 2.0, 1.0, 1.5])
    for slots in ([0, 0, 1, 1, 3, 3, -1], [3, -1, 0, 1, 0, 2, 1, 3, 3, 3]):
        meta = LoRABatchMeta.build(slots, ranks)
        x = torch.randn(len(slots), K, generator=g)
        y = torch.randn(len(slots), offs[-1], generator=g)
        expected = y.clone()
        reference_expand(reference_shrink(x, a, meta, scale), b, meta, expected, offs)
        ops.add_lora(y, x, a, bd, meta, scale, offs, backend="torch", blockdiag=True)
        torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5)
    assert sum(widths) == offs[-1]
    # Pre-scaled A, LoRA tokens leading the batch in consecutive slots: the in-place batched
    # path, also with a bf16 y over fp32 slots (B never cast to y's dtype).
    meta = LoRABatchMeta.build([0, 0, 1, 1, -1], ranks)
    assert meta.identity_tokens and meta.chunk_slot_start == 0
    for y_dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(5, K, generator=g).to(y_dtype)
        y = torch.randn(5, offs[-1], generator=g).to(y_dtype)
        expected = y.float()
        reference_expand(reference_shrink(x.float(), a, meta, scale), b, meta, expected, offs)
        ops.add_lora(y, x, a * scale.view(-1, 1, 1, 1), bd, meta, None, offs, backend="torch",
                     blockdiag=True)
        tol = 1e-5 if y_dtype == torch.float32 else 3e-2
        torch.testing.assert_close(y.float(), expected, rtol=tol, atol=tol)


@pytest.mark.parametrize("y_dtype", [torch.float32, torch.bfloat16])
def test_blockdiag_runs_path_matches_reference(y_dtype, cpu_lora_path):
    """Mixed traffic (decodes of several adapters, base rows, then prompt chunks of other
    adapters): few runs take the per-run GEMMs on views; equal to the reference, also with
    a bf16 y and fp32 slot weights (CPUs without bf16 GEMMs); many runs take the padded path."""
    from loramux.engine.lora.ops import torch_ops

    g = torch.Generator().manual_seed(11)
    num_slots, R, K, offs = 4, 8, 40, [0, 24, 32, 40]
    a = torch.randn(num_slots, 3, R, K, generator=g)
    b = torch.randn(num_slots, offs[-1], R, generator=g)
    ranks = torch.tensor([8, 3, 0, 5])
    for slot, r in enumerate(ranks.tolist()):
        a[slot, :, r:] = 0
        b[slot, :, r:] = 0
    bd = torch.zeros(num_slots, 3 * R, offs[-1])
    for s in range(3):
        bd[:, s * R : (s + 1) * R, offs[s] : offs[s + 1]] = b[:, offs[s] : offs[s + 1]].transpose(1, 2)
    scale = torch.tensor([0.5, 2.0, 1.0, 1.5])
    from loramux.engine.lora.ops.cpu_sgmv import max_kernel_run

    # 6 runs with rank > 0, the last longer than the kernel takes (GEMMs beside it)
    few = [0, 1, 3, -1, -1] + [3] * 9 + [2] * 3 + [0] * 6 + [1] * (max_kernel_run(3) + 7)
    many = [0, 1] * (torch_ops._MAX_RUNS + 1)
    for slots, expect_runs in ((few, 6), (many, 2 * torch_ops._MAX_RUNS + 2)):
        meta = LoRABatchMeta.build(slots, ranks)
        assert len(meta.runs) == expect_runs and not meta.identity_tokens
        x = torch.randn(len(slots), K, generator=g).to(y_dtype)
        y = torch.randn(len(slots), offs[-1], generator=g).to(y_dtype)
        expected = y.float()
        reference_expand(reference_shrink(x.float(), a, meta, scale), b, meta, expected, offs)
        ops.add_lora(y, x, a * scale.view(-1, 1, 1, 1), bd, meta, None, offs, backend="torch",
                     blockdiag=True)
        tol = 1e-5 if y_dtype == torch.float32 else 3e-2
        torch.testing.assert_close(y.float(), expected, rtol=tol, atol=tol)


@pytest.mark.parametrize("w_dtype,x_dtype,y_dtype", [
    (torch.float32, torch.float32, torch.float32), (torch.float32, torch.bfloat16, torch.bfloat16),
    (torch.bfloat16, torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32, torch.bfloat16),
])
@pytest.mark.parametrize("isa", ISAS)
def test_sgmv_kernel_matches_per_run_gemms(w_dtype, x_dtype, y_dtype, isa):
    """The CPU SGMV kernel (each ISA variant this CPU runs) against the per-run GEMMs it
    replaces: mixed ranks in padded slots (rows past an adapter's rank are not read: filled
    with NaN here), column counts off the kernel's tile and vector widths, base rows between
    runs left untouched."""
    with forced_isa(isa):
        _sgmv_kernel_matches_per_run_gemms(w_dtype, x_dtype, y_dtype)


def _sgmv_kernel_matches_per_run_gemms(w_dtype, x_dtype, y_dtype):
    from loramux.engine.lora.ops import cpu_sgmv

    require_cpu_kernel()
    g = torch.Generator().manual_seed(5)
    S, R, K, N = 3, 8, 45, 150
    ranks = [8, 3, 5]
    a = torch.full((3, S, R, K), float("nan"))
    b = torch.full((3, S * R, N), float("nan"))
    clean_a, clean_b = torch.zeros_like(a), torch.zeros_like(b)
    for slot, r in enumerate(ranks):
        for s in range(S):
            lo, hi = s * N // S, (s + 1) * N // S
            wa = torch.randn(r, K, generator=g) * 0.2
            wb = torch.randn(r, hi - lo, generator=g) * 0.2
            a[slot, s, :r], clean_a[slot, s, :r] = wa, wa
            b[slot, s * R : s * R + r] = 0
            b[slot, s * R : s * R + r, lo:hi], clean_b[slot, s * R : s * R + r, lo:hi] = wb, wb
    runs = [(0, 1, 2), (1, 4, 0), (6, 7, 1), (7, 12, 2)]  # rows 4-5 and 12 are base rows
    x = torch.randn(13, K, generator=g).to(x_dtype)
    y = torch.randn(13, N, generator=g).to(y_dtype)
    expected = y.clone()
    torch_ops._add_runs(expected, x, clean_a.to(w_dtype), clean_b.to(w_dtype), runs, S * R)
    got = y.clone()
    offs = [s * N // S for s in range(S + 1)]
    tol = 1e-5 if y_dtype == torch.float32 and w_dtype == torch.float32 else 2e-2
    cpu_sgmv.add_runs_sgmv(got, x, a.to(w_dtype), b.to(w_dtype), torch.tensor(runs), torch.tensor(ranks), offs)
    with pytest.raises(ValueError, match="slice_offsets"):
        cpu_sgmv.add_runs_sgmv(got, x, a, b, torch.tensor(runs), torch.tensor(ranks), [0, N])
    # the rank-only GEMMs of long runs never read the padding (NaN) either
    ranked = y.clone()
    torch_ops._add_runs_ranked(ranked, x, a.to(w_dtype), b.to(w_dtype), runs, ranks, offs)
    torch.testing.assert_close(ranked.float(), expected.float(), rtol=tol, atol=tol)
    assert torch.equal(got[[4, 5, 12]], y[[4, 5, 12]])
    torch.testing.assert_close(got.float(), expected.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("isa,dtype", [("auto", torch.float32), ("avx512bf16", torch.bfloat16),
                                       ("avx2", torch.bfloat16)])
def test_sgmv_kernel_split_over_threads_matches_per_run_gemms(isa, dtype):
    """A prompt-sized call above the kernel's PARALLEL_MIN_MACS (600 tokens x 2 slices x rank-32
    slots x (K + N) = 1800: 69M >= 2**15) runs its shrink and expand split over threads: the same sums as
    the per-run GEMMs, runs of several slots and ranks, base rows untouched; in bf16 (x, slots
    and y) too, whose prompt runs the native-bf16 variant takes up to 1024 tokens
    (``cpu_sgmv.SGMV_MAX_RUN_NATIVE_BF16``)."""
    if isa == "auto":
        require_cpu_kernel()
        _split_over_threads(dtype)
        return
    with forced_isa(isa):
        _split_over_threads(dtype)


def _blockdiag_slots(ranks, R, K, offsets, g):
    """fp32 slots [len(ranks), S, R, K] (A, pre-scaled) and [len(ranks), S * R, N] (block-diagonal
    B) for S = len(offsets) - 1 slices with output columns ``offsets``: random rows up to each
    slot's rank, zeros beyond."""
    S = len(offsets) - 1
    a = torch.zeros(len(ranks), S, R, K)
    b = torch.zeros(len(ranks), S * R, offsets[-1])
    for slot, r in enumerate(ranks):
        for s in range(S):
            lo, hi = offsets[s], offsets[s + 1]
            a[slot, s, :r] = torch.randn(r, K, generator=g) * 0.05
            b[slot, s * R : s * R + r, lo:hi] = torch.randn(r, hi - lo, generator=g) * 0.05
    return a, b


def _split_over_threads(dtype):
    from loramux.engine.lora.ops import cpu_sgmv

    g = torch.Generator().manual_seed(11)
    S, R, K, N = 2, 32, 900, 900
    ranks = [32, 16, 8]
    a, b = _blockdiag_slots(ranks, R, K, [s * N // S for s in range(S + 1)], g)
    runs = [(0, 250, 0), (250, 251, 1), (260, 610, 2)]  # rows 251-259 are base rows
    x = torch.randn(610, K, generator=g).to(dtype)
    y = torch.randn(610, N, generator=g).to(dtype)
    a, b = a.to(dtype), b.to(dtype)
    expected = y.float().clone()  # (a copy: .float() of fp32 is y itself)
    torch_ops._add_runs(expected, x.float(), a.float(), b.float(), runs, S * R)
    got = y.clone()
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        cpu_sgmv.add_runs_sgmv(got, x, a, b, torch.tensor(runs), torch.tensor(ranks),
                               [s * N // S for s in range(S + 1)])
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(got[251:260], y[251:260])
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.float(), expected, rtol=tol, atol=tol)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("runs", [[(0, 1, 1)], [(0, 1, 2), (1, 2, 0), (3, 4, 1), (4, 5, 2)]],
                         ids=["one-token", "four-adapters"])
def test_sgmv_decode_call_split_over_threads_is_the_one_thread_call(isa, dtype, runs):
    """A decode call (one token a run, 3 slices of rank-32 slots, K = N = 256: 2**16.6 MACs a token
    >= PARALLEL_MIN_MACS) splits its slices and column tiles over 2 threads, even with one run:
    bit for bit the 1-thread call's sums, matching the per-run GEMMs; the base row untouched."""
    from loramux.engine.lora.ops import cpu_sgmv

    g = torch.Generator().manual_seed(5)
    S, R, K, N = 3, 32, 256, 256
    ranks = [16, 8, 32]
    offsets = [0, 128, 192, 256]
    a, b = _blockdiag_slots(ranks, R, K, offsets, g)
    x = torch.randn(5, K, generator=g).to(dtype)
    y = torch.randn(5, N, generator=g).to(dtype)
    a, b = a.to(dtype), b.to(dtype)
    expected = y.float().clone()
    torch_ops._add_runs(expected, x.float(), a.float(), b.float(), runs, S * R)
    threads = torch.get_num_threads()
    got = {}
    with forced_isa(isa):
        for n in (1, 2):
            got[n] = y.clone()
            torch.set_num_threads(n)
            try:
                cpu_sgmv.add_runs_sgmv(got[n], x, a, b, torch.tensor(runs), torch.tensor(ranks), offsets)
            finally:
                torch.set_num_threads(threads)
    assert torch.equal(got[2], got[1])
    touched = sorted({t for start, end, _ in runs for t in range(start, end)})
    untouched = [t for t in range(5) if t not in touched]
    assert torch.equal(got[2][untouched], y[untouched])
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got[2].float(), expected, rtol=tol, atol=tol)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("w_dtype", [torch.float32, torch.bfloat16])
def test_sgmv_bf16_output_rounds_once_as_torch(isa, w_dtype):
    """A bf16 y gets ``(y + delta).to(bf16)`` bit for bit, delta being the fp32 sum the same
    kernel adds to an fp32 zero y (the vector rounding of the AVX2 variant = torch's round to
    nearest even; columns past the last full vector take the scalar path; NaN stays NaN)."""
    from loramux.engine.lora.ops import cpu_sgmv

    with forced_isa(isa):
        g = torch.Generator().manual_seed(11)
        S, R, K, N = 2, 8, 40, 203  # 203 columns: tiles of 64, then 11 past the last vector
        ranks = torch.tensor([8, 5])
        a = (torch.randn(2, S, R, K, generator=g) * 0.3).to(w_dtype)
        b = torch.zeros(2, S * R, N)
        offs = [0, 150, N]
        for s in range(S):
            b[:, s * R : (s + 1) * R, offs[s] : offs[s + 1]] = torch.randn(2, R, offs[s + 1] - offs[s], generator=g)
        b = b.to(w_dtype)
        runs = torch.tensor([[0, 5, 0], [5, 6, 1], [7, 10, 1]])  # row 6 has no adapter
        x = torch.randn(10, K, generator=g).to(torch.bfloat16)
        delta = torch.zeros(10, N)
        cpu_sgmv.add_runs_sgmv(delta, x, a, b, runs, ranks, offs)
        y = (torch.randn(10, N, generator=g) * 4).to(torch.bfloat16)
        y[1, 3] = float("nan")
        expected = (y.float() + delta).to(torch.bfloat16)
        cpu_sgmv.add_runs_sgmv(y, x, a, b, runs, ranks, offs)
        assert y.isnan().sum() == 1 and bool(y[1, 3].isnan())  # NaN stays NaN (its payload aside)
        y[1, 3] = expected[1, 3] = 0
        assert torch.equal(y.view(torch.int16), expected.view(torch.int16))


def test_sgmv_takes_short_runs_and_gemms_the_long_ones():
    from loramux.engine.lora.ops.cpu_sgmv import max_kernel_run, split_runs

    for dt in (torch.float32, torch.bfloat16):
        assert max_kernel_run(4, dt) == max_kernel_run(8, dt) >= max_kernel_run(16, dt) > max_kernel_run(64, dt)
    # the slots' dtype picks the table: a run between the two dtypes' limits for rank 16 goes to
    # the kernel in one and to the GEMMs in the other (bf16 GEMMs pay oneDNN's ~25 us a call)
    n = max_kernel_run(16) + 1
    assert n <= max_kernel_run(16, torch.bfloat16)
    assert split_runs(LoRABatchMeta.build([0] * n, torch.tensor([16])))[1] == [(0, n, 0)]
    bf16 = LoRABatchMeta.build([0] * n, torch.tensor([16]))
    assert split_runs(bf16, torch.bfloat16)[0].tolist() == [[0, n, 0]]
    ranks = torch.tensor([8, 16, 0])
    top8, top16 = max_kernel_run(8), max_kernel_run(16)
    long = top16 + 5  # beyond the kernel for rank 16, within it for rank 8
    slots = [1] * 3 + [0] * top8 + [1] * long + [0] * long + [0, -1, 0] + [0] * top8 + [-1]
    meta = LoRABatchMeta.build(slots, ranks)
    table, gemm_runs, slot_ranks = split_runs(meta)
    e = 3 + top8 + long  # end of the rank-16 long run
    assert table.tolist() == [[0, 3, 1], [3, 3 + top8, 0], [e, e + long + 1, 0]]
    assert gemm_runs == [(3 + top8, e, 1), (e + long + 2, e + long + 3 + top8, 0)]
    assert slot_ranks == [8, 16, 0]
    assert split_runs(meta)[0] is table  # once per step: every layer reads the memo


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("amx", [False, True])
def test_sgmv_run_table_follows_the_kernel_variant(isa, amx, monkeypatch):
    """bf16 slots take the native-bf16 table (long prompt runs in the kernel) only in the
    avx512bf16 variant on a CPU without AMX; every other variant, and any CPU whose oneDNN has AMX
    tiles, keeps the table whose long runs go to GEMMs; fp32 slots always keep theirs."""
    from loramux.engine.lora.ops import cpu_sgmv

    monkeypatch.setattr(cpu_sgmv, "_cpu_has_amx", lambda: amx)
    with forced_isa(isa):
        native = isa == "avx512bf16" and not amx
        want = cpu_sgmv.SGMV_MAX_RUN_NATIVE_BF16 if native else cpu_sgmv.SGMV_MAX_RUN_BY_RANK[torch.bfloat16]
        assert cpu_sgmv.run_table(torch.bfloat16) == want
        assert cpu_sgmv.run_table(torch.float32) == cpu_sgmv.SGMV_MAX_RUN_BY_RANK[torch.float32]
        n = 600  # a prompt run of a rank-16 adapter: the kernel's only in the native table
        meta = LoRABatchMeta.build([0] * n, torch.tensor([16]))
        table, gemm_runs, _ = cpu_sgmv.split_runs(meta, torch.bfloat16)
        assert (table.tolist(), gemm_runs) == (([[0, n, 0]], []) if native else ([], [(0, n, 0)]))


@pytest.mark.parametrize("isa", ["avx512bf16", "avx2"])
def test_sgmv_hostile_long_bf16_run_keeps_out_of_a_neighbours_rows(isa):
    """A tenant's adapter of NaN and huge weights on a 600-token bf16 prompt run (the kernel's since
    the native-bf16 table, split over threads) beside a neighbour's run in the same call: the
    neighbour's rows are bit for bit those of a call holding its run alone, the base rows between
    are untouched."""
    from loramux.engine.lora.ops import cpu_sgmv

    with forced_isa(isa):
        g = torch.Generator().manual_seed(13)
        S, R, K, N = 2, 32, 576, 640
        a = torch.zeros(2, S, R, K)
        b = torch.zeros(2, S * R, N)
        for s in range(S):
            lo, hi = s * N // S, (s + 1) * N // S
            a[0, s] = float("nan")
            a[0, s, ::2] = 3e38
            b[0, s * R : (s + 1) * R, lo:hi] = 3e38
            a[1, s, :16] = torch.randn(16, K, generator=g) * 0.05
            b[1, s * R : s * R + 16, lo:hi] = torch.randn(16, hi - lo, generator=g) * 0.05
        a, b = a.to(torch.bfloat16), b.to(torch.bfloat16)
        ranks, offs = torch.tensor([32, 16]), [0, N // 2, N]
        x = torch.randn(700, K, generator=g).to(torch.bfloat16)
        y = torch.randn(700, N, generator=g).to(torch.bfloat16)
        alone = y.clone()
        cpu_sgmv.add_runs_sgmv(alone, x, a, b, torch.tensor([(610, 700, 1)]), ranks, offs)
        both = y.clone()
        threads = torch.get_num_threads()
        torch.set_num_threads(2)
        try:
            cpu_sgmv.add_runs_sgmv(both, x, a, b, torch.tensor([(0, 600, 0), (610, 700, 1)]), ranks, offs)
        finally:
            torch.set_num_threads(threads)
        assert not both[:600].isfinite().all()  # the hostile rows are its own business
        assert torch.equal(both[600:610], y[600:610])
        assert torch.equal(both[610:].view(torch.int16), alone[610:].view(torch.int16))
