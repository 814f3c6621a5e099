"""The compiled CPU operators (``torch.ops.loramux.*``) as operators: every wrong argument
raises a clear exception (never a crash or a write outside a tensor), the fake
implementations give the shapes and dtypes without data, the profiler names each call,
every ISA variant this CPU runs agrees, the new family arguments (softmax scale, sliding
window, logit soft-cap; Gemma's ``(1 + w)`` norm; tanh-GELU) match torch eager and
transformers, and an engine without the extension runs on torch ops and says so."""

from __future__ import annotations

import math
import sys

import pytest
import torch
import torch.nn.functional as F
from support.cpu_kernel import ISAS, forced_isa, require_cpu_kernel

from loramux.engine.model.kernels import loader
from loramux.engine.model.kernels import ops as kernels


@pytest.fixture(autouse=True)
def _kernels():
    require_cpu_kernel()


# --- one valid call per operator, to break one argument at a time ------------------------

def attention_args(dtype=torch.float32, heads=4, kv_heads=2, head_dim=16, block=4):
    """Two sequences over a 10-block cache: a decode row (context 7), a 3-row chunk (context 9)."""
    g = torch.Generator().manual_seed(0)
    slots = 10 * block + 1
    return dict(
        q=torch.randn(4, heads, head_dim, generator=g).to(dtype),
        k_cache=torch.randn(slots, kv_heads, head_dim, generator=g).to(dtype),
        v_cache=torch.randn(slots, kv_heads, head_dim, generator=g).to(dtype),
        out=torch.zeros(4, heads * head_dim, dtype=dtype),
        block_tables=torch.tensor([[3, 7, 0], [1, 5, 9]], dtype=torch.int32),
        row_start=torch.tensor([0, 1], dtype=torch.int32),
        num_new=torch.tensor([1, 3], dtype=torch.int32),
        ctx_len=torch.tensor([7, 9], dtype=torch.int32),
        block_size=block, scale=0.25,
    )


def _randn(*shape, dtype=torch.float32, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def norm_args(dtype=torch.float32):
    return dict(residual=_randn(3, 32, dtype=dtype), delta=_randn(3, 32, dtype=dtype, seed=1),
                weight=_randn(32, dtype=dtype, seed=2), eps=1e-6)


def rope_args(dtype=torch.float32):
    return dict(qk=_randn(5, 3, 8, dtype=dtype), positions=torch.tensor([0, 1, 2, 3, 9]),
                cos=_randn(10, 8, dtype=dtype, seed=1), sin=_randn(10, 8, dtype=dtype, seed=2))


def gate_up_args(dtype=torch.float32):
    return dict(gate_up=_randn(3, 20, dtype=dtype) * 3)


def sgmv_args(dtype=torch.float32):
    slots, S, R, K, N = 3, 2, 4, 16, 24
    return dict(y=torch.zeros(6, N), x=_randn(6, K), a=_randn(slots, S, R, K, dtype=dtype, seed=1),
                b=_randn(slots, S * R, N, dtype=dtype, seed=2),
                runs=torch.tensor([[0, 2, 1], [3, 6, 0]]), ranks=torch.tensor([4, 2, 0]),
                slice_offsets=torch.tensor([0, 16, 24]))


CALLS = {
    "paged_attention": (kernels.paged_attention, attention_args),
    "add_rms_norm": (lambda **a: kernels.add_rms_norm(a.pop("residual"), a.pop("delta"),
                                                      a.pop("weight"), a.pop("eps"), **a), norm_args),
    "rope": (kernels.rope, rope_args),
    "silu_mul": (kernels.silu_mul, gate_up_args),
    "gelu_tanh_mul": (kernels.gelu_tanh_mul, gate_up_args),
    "lora_sgmv": (kernels.lora_sgmv, sgmv_args),
}


def _call(op, **changes):
    fn, make = CALLS[op]
    args = make()
    args.update(changes)
    return fn(**args)


@pytest.mark.parametrize("op", list(CALLS))
def test_every_operator_runs_on_valid_arguments(op):
    _call(op)


BAD = [
    # (operator, argument -> replacement, exception, message fragment)
    ("paged_attention", {"q": torch.randn(4, 4, 16, dtype=torch.float16)}, RuntimeError, "float32 or bfloat16"),
    ("paged_attention", {"q": torch.randn(4, 16, 4).transpose(1, 2)}, RuntimeError, "heads and dims dense"),
    ("paged_attention", {"k_cache": torch.randn(41, 2, 16).to(torch.bfloat16)}, RuntimeError, "dtype of q"),
    ("paged_attention", {"k_cache": torch.randn(41, 3, 16)}, RuntimeError, "one shape"),
    ("paged_attention", {"v_cache": torch.randn(41, 16, 2).transpose(1, 2)}, RuntimeError, "contiguous"),
    ("paged_attention", {"out": torch.zeros(4, 60)}, RuntimeError, "H * D"),
    ("paged_attention", {"out": torch.zeros(2, 64)}, ValueError, "outside the 2 rows"),
    ("paged_attention", {"block_tables": torch.tensor([[3, 7, 0], [1, 5, 9]])}, RuntimeError, "Int"),
    ("paged_attention", {"block_tables": torch.tensor([[3, 7, 0], [1, 5, 11]], dtype=torch.int32)},
     ValueError, "outside the cache"),
    ("paged_attention", {"block_tables": torch.tensor([[3, -1, 0], [1, 5, 9]], dtype=torch.int32)},
     ValueError, "names block -1"),
    ("paged_attention", {"ctx_len": torch.tensor([7, 13], dtype=torch.int32)}, ValueError, "block table of 3 x 4"),
    ("paged_attention", {"ctx_len": torch.tensor([7, 2], dtype=torch.int32)}, ValueError, "context length 2 for 3"),
    ("paged_attention", {"num_new": torch.tensor([1, 3, 1], dtype=torch.int32)}, RuntimeError, "one entry per"),
    ("paged_attention", {"row_start": torch.tensor([0, 3], dtype=torch.int32)}, ValueError, "outside the 4 rows"),
    ("paged_attention", {"block_size": 0}, ValueError, "block_size"),
    ("paged_attention", {"window": -1}, ValueError, "window"),
    ("paged_attention", {"softcap": -2.0}, ValueError, "softcap"),
    ("paged_attention", {"scale": float("nan")}, ValueError, "scale"),
    ("add_rms_norm", {"residual": torch.randn(32, 3).t()}, RuntimeError, "dense rows"),
    ("add_rms_norm", {"residual": torch.randn(3, 32).to(torch.float16)}, RuntimeError, "float32 or bfloat16"),
    ("add_rms_norm", {"delta": torch.randn(3, 31)}, RuntimeError, "shape of residual"),
    ("add_rms_norm", {"weight": torch.randn(31)}, RuntimeError, "weight must be [32]"),
    ("add_rms_norm", {"weight": torch.randn(32).to(torch.bfloat16)}, RuntimeError, "dtype of residual"),
    ("add_rms_norm", {"out_dtype": torch.int64}, RuntimeError, "out_dtype"),
    ("add_rms_norm", {"residual": torch.randn(3, 32, 1)}, RuntimeError, "2 dimensions"),
    ("rope", {"positions": torch.tensor([0, 1, 2, 3, 10])}, ValueError, "position 10"),
    ("rope", {"positions": torch.tensor([0, 1, 2, 3, -1])}, ValueError, "position -1"),
    ("rope", {"positions": torch.tensor([0, 1, 2, 3, 4], dtype=torch.int32)}, RuntimeError, "Long"),
    ("rope", {"positions": torch.tensor([0, 1, 2])}, RuntimeError, "one entry per token"),
    ("rope", {"cos": torch.randn(10, 6)}, RuntimeError, "cos must be [positions, 8]"),
    ("rope", {"qk": torch.randn(5, 3, 7)}, RuntimeError, "even"),
    ("rope", {"qk": torch.randn(5, 8, 3).transpose(1, 2)}, RuntimeError, "heads and dims dense"),
    ("rope", {"qk": torch.randn(1, 3, 8).expand(5, 3, 8)}, RuntimeError, "share memory"),
    ("add_rms_norm", {"residual": torch.randn(1, 32).expand(3, 32)}, RuntimeError, "share memory"),
    ("lora_sgmv", {"y": torch.zeros(1, 24).expand(6, 24)}, RuntimeError, "share memory"),
    ("paged_attention", {"q": torch.randn(4, 4, 0)}, RuntimeError, "head dim"),
    ("silu_mul", {"gate_up": torch.randn(3, 21)}, RuntimeError, "2 * I"),
    ("silu_mul", {"gate_up": torch.randn(20, 3).t()}, RuntimeError, "dense rows"),
    ("gelu_tanh_mul", {"gate_up": torch.randn(3, 20, dtype=torch.float64)}, RuntimeError, "float32 or bfloat16"),
    ("lora_sgmv", {"runs": torch.tensor([[0, 2, 3]])}, ValueError, "names slot 3"),
    ("lora_sgmv", {"runs": torch.tensor([[0, 7, 0]])}, ValueError, "within the 6 tokens"),
    ("lora_sgmv", {"runs": torch.tensor([[2, 4, 0], [3, 5, 1]])}, ValueError, "disjoint"),
    ("lora_sgmv", {"runs": torch.tensor([[0, 2, 1]], dtype=torch.int32)}, RuntimeError, "Long"),
    ("lora_sgmv", {"ranks": torch.tensor([4, 5, 0])}, ValueError, "rank 5"),
    ("lora_sgmv", {"slice_offsets": torch.tensor([0, 24])}, ValueError, "slice_offsets"),
    ("lora_sgmv", {"slice_offsets": torch.tensor([0, 20, 16])}, ValueError, "slice_offsets"),
    ("lora_sgmv", {"x": torch.randn(6, 15)}, RuntimeError, "K = 16"),
    ("lora_sgmv", {"x": torch.randn(5, 16)}, RuntimeError, "one row per token"),
    ("lora_sgmv", {"b": torch.randn(3, 8, 24).to(torch.bfloat16)}, RuntimeError, "dtype of a"),
    ("lora_sgmv", {"b": torch.randn(3, 7, 24)}, RuntimeError, "S * R"),
    ("lora_sgmv", {"a": torch.randn(3, 2, 16, 4).transpose(2, 3)}, RuntimeError, "contiguous"),
]


@pytest.mark.parametrize("op,changes,exc,fragment", BAD, ids=[f"{b[0]}-{i}" for i, b in enumerate(BAD)])
def test_a_wrong_argument_raises_a_clear_error(op, changes, exc, fragment):
    with pytest.raises(exc, match=f"loramux::{op}.*{_re(fragment)}"):
        _call(op, **changes)


def _re(text: str) -> str:
    import re

    return re.escape(text)


@pytest.mark.parametrize("op", [op for op in CALLS if not op.endswith("_mul")])  # 1 tensor
def test_a_tensor_on_another_device_raises(op):
    """A meta tensor beside CPU ones dispatches to the fake implementation, which refuses the
    mix (CUDA tensors would reach it the same way)."""
    _, make = CALLS[op]
    args = make()
    name = next(k for k, v in args.items() if isinstance(v, torch.Tensor))
    args[name] = args[name].to("meta")
    with pytest.raises(RuntimeError, match="one device"):
        CALLS[op][0](**args)


def test_fake_implementations_give_shapes_and_dtypes_without_data():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        out = kernels.add_rms_norm(torch.empty(5, 32, dtype=torch.bfloat16), None,
                                   torch.empty(32, dtype=torch.bfloat16), 1e-6, out_dtype=torch.float32)
        assert out.shape == (5, 32) and out.dtype == torch.float32
        act = kernels.gelu_tanh_mul(torch.empty(7, 40), out_dtype=torch.bfloat16)
        assert act.shape == (7, 20) and act.dtype == torch.bfloat16
        assert kernels.silu_mul(torch.empty(2, 8)).shape == (2, 4)
        args = {k: (torch.empty_like(v) if isinstance(v, torch.Tensor) else v)
                for k, v in attention_args().items()}
        kernels.paged_attention(**args)  # checks pass, nothing computed
        with pytest.raises(RuntimeError, match="H \\* D"):
            kernels.paged_attention(**{**args, "out": torch.empty(4, 10)})
        with pytest.raises(RuntimeError, match="gate \\| up"):
            kernels.silu_mul(torch.empty(2, 7))
    meta = kernels.add_rms_norm(torch.empty(2, 8, device="meta"), None,
                                torch.empty(8, device="meta"), 1e-6)
    assert meta.device.type == "meta" and meta.shape == (2, 8)


def test_profiler_names_each_operator():
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for op in CALLS:
            _call(op)
    names = {e.key for e in prof.key_averages()}
    assert {f"loramux::{op}" for op in CALLS} <= names, sorted(n for n in names if "loramux" in n)


@pytest.mark.parametrize("isa", ISAS)
def test_every_isa_variant_agrees_with_the_scalar_one(isa):
    """The same calls under each ISA variant this CPU runs equal the scalar variant's results
    (fp32: within float rounding; the norms and activations: bf16-exact bar rare ties)."""
    def run_all():
        outs = []
        for dtype in (torch.float32, torch.bfloat16):
            args = attention_args(dtype)
            kernels.paged_attention(**args)
            outs.append(args["out"])
            a = norm_args(dtype)
            outs.append(kernels.add_rms_norm(a["residual"], a["delta"], a["weight"], a["eps"]))
            outs.append(a["residual"])
            outs.append(kernels.add_rms_norm(a["residual"], None, a["weight"], a["eps"], unit_offset=True))
            outs.append(kernels.rope(**rope_args(dtype)))
            gu = torch.randn(9, 2 * 37, generator=torch.Generator().manual_seed(3)).to(dtype) * 4
            outs += [kernels.silu_mul(gu), kernels.gelu_tanh_mul(gu)]
            s = sgmv_args(dtype)
            kernels.lora_sgmv(**s)
            outs.append(s["y"])
        return outs

    with forced_isa("scalar"):
        expected = run_all()
    with forced_isa(isa):
        assert loader.status().isa == isa
        got = run_all()
    # the avx512bf16 variant's bf16 paths (VDPBF16PS) round the attention's probabilities to bf16
    # for p . v (as torch's bf16 attention does): up to 2**-9 of the p-weighted |v| (~1 here),
    # not of the output, so bf16 outputs near zero need an absolute bound
    atol_bf16 = 4e-3 if isa == "avx512bf16" else 1e-5
    for e, g in zip(expected, got, strict=True):
        torch.testing.assert_close(g.float(), e.float(), rtol=2e-2 if g.dtype == torch.bfloat16 else 1e-5,
                                   atol=atol_bf16 if g.dtype == torch.bfloat16 else 1e-5)


def test_an_isa_this_cpu_lacks_is_refused():
    with pytest.raises(ValueError, match="unknown ISA 'sse9'"):
        loader.select_isa("sse9")
    lacking = [i for i in ISAS if i not in loader.isas()]
    if lacking:
        with pytest.raises(ValueError, match="cannot run"):
            loader.select_isa(lacking[0])
    assert loader.select_isa("auto") == loader.isas()[0]


# --- the model families' arguments against torch eager and transformers ------------------

def dense_attention(q, k_cache, v_cache, tables, row_start, num_new, ctx_len, block, scale, window, softcap):
    """Each sequence's rows over its context: keys gathered, masked, softmax in float64."""
    out = torch.zeros(q.shape[0], q.shape[1] * q.shape[2], dtype=torch.float64)
    group = q.shape[1] // k_cache.shape[1]
    for s in range(len(tables)):
        ctx, n, r0 = int(ctx_len[s]), int(num_new[s]), int(row_start[s])
        slots = torch.tensor([int(tables[s][j // block]) * block + j % block for j in range(ctx)])
        keys = k_cache[slots].double().repeat_interleave(group, 1)  # [ctx, H, D]
        vals = v_cache[slots].double().repeat_interleave(group, 1)
        qs = q[r0 : r0 + n].double()  # [n, H, D]
        scores = torch.einsum("nhd,chd->hnc", qs, keys) * scale
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        pos = torch.arange(ctx - n, ctx).unsqueeze(1)
        key = torch.arange(ctx).unsqueeze(0)
        visible = key <= pos
        if window:
            visible &= key > pos - window
        scores = scores.masked_fill(~visible, float("-inf"))
        out[r0 : r0 + n] = torch.einsum("hnc,chd->nhd", scores.softmax(-1), vals).reshape(n, -1)
    return out


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("scale,window,softcap", [
    (None, 0, 0.0), (0.1, 0, 0.0), (None, 5, 0.0), (None, 0, 2.0), (0.3, 7, 1.5), (None, 40, 50.0),
])
def test_attention_scale_window_and_softcap_match_eager(isa, dtype, tol, scale, window, softcap):
    """Decode rows and prompt chunks long enough for the tiled path (GQA 3:1), each with the
    softmax scale, sliding window and logit soft-cap given per call."""
    g = torch.Generator().manual_seed(11)
    heads, kv_heads, head_dim, block = 6, 2, 24, 8
    rows = [(37, 1), (5, 1), (60, 70), (0, 12)]  # (computed, new)
    blocks = iter(torch.randperm(60, generator=g).tolist())
    tables = [[next(blocks) for _ in range(-(-(s + n) // block))] for s, n in rows]
    width = max(map(len, tables))
    t = torch.tensor([tb + [0] * (width - len(tb)) for tb in tables], dtype=torch.int32)
    total = sum(n for _, n in rows)
    row_start = torch.tensor([sum(n for _, n in rows[:i]) for i in range(len(rows))], dtype=torch.int32)
    num_new = torch.tensor([n for _, n in rows], dtype=torch.int32)
    ctx_len = torch.tensor([s + n for s, n in rows], dtype=torch.int32)
    q = (torch.randn(total, heads, head_dim, generator=g) * 2).to(dtype)
    k_cache = (torch.randn(60 * block, kv_heads, head_dim, generator=g) * 2).to(dtype)
    v_cache = torch.randn(60 * block, kv_heads, head_dim, generator=g).to(dtype)
    sc = 1.0 / math.sqrt(head_dim) if scale is None else scale
    out = torch.zeros(total, heads * head_dim, dtype=dtype)
    with forced_isa(isa):
        kernels.paged_attention(q, k_cache, v_cache, out, t, row_start, num_new, ctx_len,
                                block_size=block, scale=sc, window=window, softcap=softcap)
    expected = dense_attention(q, k_cache, v_cache, tables, row_start, num_new, ctx_len, block, sc,
                               window, softcap)
    torch.testing.assert_close(out.double(), expected, atol=tol, rtol=tol)


def test_cpu_paged_attention_takes_the_family_arguments_per_call():
    """The wrapper the model calls: scale / window / softcap per call, the metadata's window
    by default."""
    from loramux.engine.model.cpu_attention import build_cpu_metadata, cpu_paged_attention

    g = torch.Generator().manual_seed(2)
    q = torch.randn(3, 4, 8, generator=g)
    kc, vc = torch.randn(33, 2, 8, generator=g), torch.randn(33, 2, 8, generator=g)
    meta = build_cpu_metadata([[1, 3, 0]], [0], [7], [3], 4, window=4)
    tables = [[1, 3, 0]]
    args = (q, kc, vc, tables, meta.row_start, meta.num_new, meta.ctx_len, 4)
    for kw, (scale, window, softcap) in (({}, (8 ** -0.5, 4, 0.0)),
                                         ({"window": 0, "scale": 0.5, "softcap": 3.0}, (0.5, 0, 3.0))):
        out = torch.zeros(3, 32)
        cpu_paged_attention(q, kc, vc, out, meta, **kw)
        torch.testing.assert_close(out.double(), dense_attention(*args, scale, window, softcap),
                                   atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hidden", [64, 37])
def test_unit_offset_norm_matches_transformers_gemma3(isa, dtype, hidden):
    """Gemma's norm ``(x * rsqrt(mean(x^2) + eps)) * (1 + w)`` in fp32, cast once: the fused
    op and the eager one against transformers' Gemma3RMSNorm, after the residual add."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

    from loramux.engine.model.small_ops import EagerOps, FusedOps

    g = torch.Generator().manual_seed(hidden)
    ref = Gemma3RMSNorm(hidden, eps=1e-6)
    with torch.no_grad():
        ref.weight.copy_(torch.randn(hidden, generator=g) * 0.5)
    ref = ref.to(dtype)
    residual = (torch.randn(9, hidden, generator=g) * 3).to(dtype)
    delta = torch.randn(9, hidden, generator=g).to(dtype)
    expected = ref(residual + delta)
    cos = sin = torch.zeros(4, 8, dtype=dtype)
    for ops in (EagerOps(cos, sin, 1e-6, dtype), FusedOps(cos, sin, 1e-6, dtype)):
        with forced_isa(isa):
            r = residual.clone()
            got = ops.add_rms_norm(r, delta, ref.weight.detach(), unit_offset=True)
        assert torch.equal(r, residual + delta), ops.name
        assert got.dtype == dtype
        if dtype == torch.bfloat16:
            assert (got != expected).float().mean() <= 0.02, ops.name  # a last-bit tie at most
            torch.testing.assert_close(got.float(), expected.float(), rtol=8e-3, atol=1e-6)
        else:
            torch.testing.assert_close(got, expected, rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,inter", [(1, 16), (6, 19), (17, 300)])
def test_gelu_tanh_mul_matches_eager_and_transformers(isa, dtype, rows, inter):
    """GeGLU with transformers' ``gelu_pytorch_tanh``: the fused op against the eager ops, in
    the range a model sees and in the tails (large |x|, where 1 + tanh cancels)."""
    from transformers.activations import ACT2FN

    from loramux.engine.model.small_ops import EagerOps, FusedOps

    g = torch.Generator().manual_seed(rows * inter)
    gu = (torch.randn(rows, 2 * inter, generator=g) * 4).to(dtype)
    gu[0, : min(4, inter)] = torch.tensor([-30.0, -9.0, 9.0, 30.0])[: min(4, inter)].to(dtype)
    gate, up = gu.chunk(2, dim=-1)
    reference = ACT2FN["gelu_pytorch_tanh"](gate) * up
    cos = sin = torch.zeros(4, 8, dtype=dtype)
    eager = EagerOps(cos, sin, 1e-6, dtype).gelu_tanh_mul(gu)
    assert torch.equal(eager, reference)
    with forced_isa(isa):
        fused = FusedOps(cos, sin, 1e-6, dtype).gelu_tanh_mul(gu)
    assert fused.dtype == dtype and fused.shape == (rows, inter)
    # Below gate -2 torch's 1 + tanh cancels (its relative error grows past a bf16 ulp) where
    # the kernel's g * sigmoid(2 k (...)) does not: equal values above, close ones everywhere.
    above = gate.float() >= -2
    if dtype == torch.bfloat16:
        assert (fused != reference)[above].float().mean() <= 1e-2
        torch.testing.assert_close(fused.float(), reference.float(), rtol=8e-3, atol=1e-5)
    else:
        torch.testing.assert_close(fused, reference, rtol=1e-5, atol=1e-6)


def test_gelu_tanh_mul_propagates_non_finite_values():
    gu = torch.zeros(2, 8)
    gu[0, 0], gu[0, 1], gu[1, 2] = float("nan"), float("inf"), float("-inf")
    out = kernels.gelu_tanh_mul(gu)
    expected = F.gelu(gu[:, :4], approximate="tanh") * gu[:, 4:]
    assert torch.equal(out.isnan(), expected.isnan())
    assert torch.isnan(out[0, 0]) and torch.isnan(out[0, 1])  # inf * up 0 = nan, as eager


# --- without the extension ----------------------------------------------------------------

@pytest.fixture
def missing_extension(monkeypatch):
    """The process as if the wheel carried no ``_C`` (a pod built without a compiler)."""
    monkeypatch.setattr(loader, "_loaded", False)
    monkeypatch.setattr(loader, "_error", None)
    monkeypatch.setitem(sys.modules, loader.EXTENSION, None)  # import raises ModuleNotFoundError


def test_a_missing_extension_is_reported_and_logged_once(missing_extension, caplog):
    with caplog.at_level("WARNING", logger=loader.__name__):
        st = loader.status()
        assert not loader.available()
    assert st.state == "degraded" and "not installed" in st.reason and "make install" in st.reason
    assert caplog.text.count("CPU kernels unavailable") == 1
    with pytest.raises(RuntimeError, match="not loaded"):
        kernels.silu_mul(torch.zeros(1, 4))


def test_an_engine_without_the_extension_runs_on_torch_and_says_so(missing_extension, tiny_model_dir):
    from support.lora_fixtures import peft_reference, teacher_forcing_gaps

    from loramux.engine import LLM, SamplingParams

    llm = LLM(str(tiny_model_dir), dtype="float32", max_model_len=128)
    engine = llm.llm_engine
    assert not engine.runner.cpu_kernel and engine.model.ops.name == "eager"
    stats = engine.stats()
    assert stats.cpu_kernels == "degraded" and "not installed" in stats.cpu_kernels_reason
    out = llm.generate([{"prompt_token_ids": list(range(100, 120))}],
                       SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0]
    gaps, _ = teacher_forcing_gaps(peft_reference(tiny_model_dir, None), out.prompt_token_ids,
                                   out.outputs[0].token_ids)
    assert max(gaps) <= 2e-3


def test_turned_off_is_disabled_not_degraded(monkeypatch):
    monkeypatch.setenv("LORAMUX_CPU_KERNELS", "0")
    st = loader.status()
    assert st.state == "disabled" and "LORAMUX_CPU_KERNELS=0" in st.reason and not loader.available()
    monkeypatch.delenv("LORAMUX_CPU_KERNELS")
    assert loader.status().state == "ok"


def test_the_isa_variable_picks_the_variant_at_load(monkeypatch):
    monkeypatch.setattr(loader, "_loaded", False)
    monkeypatch.setattr(loader, "_error", None)
    monkeypatch.setenv("LORAMUX_CPU_ISA", "scalar")
    try:
        assert loader.status().isa == "scalar"
        monkeypatch.setattr(loader, "_loaded", False)
        monkeypatch.setenv("LORAMUX_CPU_ISA", "sse9")
        st = loader.status()
        assert st.state == "degraded" and "LORAMUX_CPU_ISA=sse9" in st.reason
    finally:
        torch.ops.loramux.select_isa("auto")


def test_the_install_check_fails_only_without_the_kernels(capsys, monkeypatch):
    """``python -m loramux.engine.model.kernels.loader --require`` (``make install``)."""
    assert loader.main(["--require"]) == 0
    assert capsys.readouterr().out.startswith(f"CPU kernels: ok ({loader.status().isa} variant")
    monkeypatch.setattr(loader, "_loaded", False)
    monkeypatch.setattr(loader, "_error", None)
    monkeypatch.setitem(sys.modules, loader.EXTENSION, None)
    assert loader.main([]) == 0  # a machine without a compiler installs, saying so
    assert loader.main(["--require"]) == 1
    assert "CPU kernels: degraded: the compiled CPU kernels are not installed" in capsys.readouterr().out
