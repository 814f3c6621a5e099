"""The ``quant`` part of ``bench/gpu_check.py``: the Triton weight-only GEMM
(``engine/model/quant/triton_wq.py``) on Llama-7B projections against the bf16 torch matmul.

Schemes: W4A16 (int4, groups of 128, symmetric) and W8A16 (int8, per channel, symmetric), random
integers and scales drawn on the device and packed into the kernel's layout as a loaded layer
holds it. Per case (projection, scheme, T rows of bf16 activations): the kernel's error against
the float32 product with the dequantized weight (``gpu_check_kernels._check``: within
``max(2 x the bf16 matmul's error, 2 eps(bf16) max|ref|)``; the bf16 matmul's own error counts
rounding the dequantized weight to bf16), both times, the speedup, and the bytes each moves
(weights + scales + x + y) per second as a fraction of the ``copy`` part's rate. Both are also
timed replayed in a CUDA graph (``s_graph``: GPU time alone; the engine runs eagerly, and a
Triton launch costs the host several times a torch op's, which small decode GEMMs feel).

Goal (GPU only): W4A16 decode (T <= 16) faster than the bf16 matmul on every projection.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

SCHEMES = {"w4a16_g128": (4, 128), "w8a16_channel": (8, None)}
"""Scheme name → (bits, group size; None: per channel)."""
DECODE_T = 16
"""Rows up to which a case counts as decode (the goal's cases)."""
QUANT_GPU = dict(
    projections={"qkv": (12288, 4096), "o": (4096, 4096), "up": (11008, 4096),
                 "down": (4096, 11008)},  # (out, in)
    rows=(1, 16, 64, 1024), dtype="bfloat16",
)
"""``gpu_check.GPU_PLAN["quant"]``: Llama-7B's projections (q|k|v fused)."""
QUANT_DRY = dict(projections={"qkv": (96, 128), "down": (64, 256)}, rows=(1, 5, 40),
                 dtype="float16")  # the interpreter gets bf16 tl.dot wrong
"""``gpu_check.DRY_PLAN["quant"]``: toy sizes for the CPU dry run."""


class Weights:
    """One projection's quantized weight, its dequantized float32 reference and the bf16
    (activation dtype) copy the torch matmul reads; the last one drawn is kept for the next
    case of the same projection and scheme."""

    def __init__(self) -> None:
        self.key = None
        self.layout = self.ref = self.dense = None

    def get(self, n: int, k: int, bits: int, group: int | None, dtype: torch.dtype,
            device: torch.device):
        import torch

        from loramux.engine.model.quant.int_packed import dequantize_int
        from loramux.engine.model.quant.triton_wq import pack

        key = (n, k, bits, group, dtype)
        if key != self.key:
            self.key, self.layout, self.ref, self.dense = None, None, None, None  # free first
            g = torch.Generator(device).manual_seed(n + k + bits)
            lo = -(1 << (bits - 1))
            values = torch.randint(lo, -lo, (n, k), generator=g, device=device, dtype=torch.int32)
            groups = k // group if group else 1
            # scales so that W's rows have the norm of a trained projection's (~ 1/sqrt(k))
            scale = (torch.rand(n, groups, generator=g, device=device) * 0.5 + 0.75) / (-lo * k**0.5)
            self.layout = pack(values, scale, None, bits, group)
            self.ref = dequantize_int(values, scale, group)  # [n, k] float32
            self.dense = self.ref.to(dtype)  # [n, k] what a bf16 model holds
            self.key = key
            del values
        return self.layout, self.ref, self.dense


def quant_case(proj: str, n: int, k: int, scheme: str, T: int, dtype: torch.dtype,
               device: torch.device, timer, copy_bps: float, weights: Weights) -> dict:
    """One projection [n, k] in ``scheme`` at ``T`` rows: error, time and bandwidth of the
    kernel and of the ``dtype`` torch matmul."""
    import torch
    import torch.nn.functional as F

    from bench.gpu_check_kernels import _check
    from loramux.engine.model.quant.triton_wq import wq_matmul

    bits, group = SCHEMES[scheme]
    layout, ref_w, dense = weights.get(n, k, bits, group, dtype, device)
    g = torch.Generator(device).manual_seed(T)
    x = torch.randn(T, k, generator=g, device=device).to(dtype)  # [T, k]
    ref = x.float() @ ref_w.T  # [T, n] float32

    def kernel():
        return wq_matmul(x, layout, bits, group)

    def dense_mm():
        return F.linear(x, dense)

    acc = _check(kernel(), dense_mm(), ref, dtype)
    secs, secs_torch = timer(kernel), timer(dense_mm)
    graph, graph_torch = _graph_time(kernel, device), _graph_time(dense_mm, device)
    io = (T * k + T * n) * x.element_size()
    moved = sum(t.numel() * t.element_size() for t in layout.values()) + io
    moved_torch = dense.numel() * dense.element_size() + io
    return dict(
        proj=proj, scheme=scheme, bits=bits, group=group, N=n, K=k, T=T,
        dtype=str(dtype).removeprefix("torch."), **acc, s=secs, s_torch=secs_torch,
        speedup_vs_torch=secs_torch / secs, s_graph=graph, s_torch_graph=graph_torch,
        speedup_graph=graph_torch / graph if graph and graph_torch else None,
        bytes=moved, bytes_torch=moved_torch,
        bw_frac=moved / secs / copy_bps, bw_frac_torch=moved_torch / secs_torch / copy_bps,
    )  # fmt: skip


def _graph_time(fn, device: torch.device) -> float | None:
    """Median seconds of ``fn`` replayed in a CUDA graph (GPU time without the host's launch
    cost, which eager calls pay: Triton's launch is the dearer); None on the CPU or when
    capture fails."""
    if device.type != "cuda":
        return None
    try:
        from triton.testing import do_bench_cudagraph

        return do_bench_cudagraph(fn, rep=30, return_mode="median") / 1e3
    except Exception:  # informative only: the eager time is the one judged
        return None


def quant_grid(plan: dict) -> list[tuple]:
    """``(proj, n, k, scheme, T)`` in the order they run: per projection and scheme (one weight
    drawn), decode rows first."""
    return [(proj, n, k, scheme, T)
            for proj, (n, k) in plan["quant"]["projections"].items()
            for scheme in SCHEMES
            for T in plan["quant"]["rows"]]


def quant_part(check) -> dict:
    """The part as ``gpu_check.Check`` runs it: every case of the grid until the part's share
    of the budget is spent (the last weights freed before the next part)."""
    import torch

    copy_bps = (check.report.get("copy") or {}).get("bytes_per_s") or float("nan")
    dtype, weights = getattr(torch, check.plan["quant"]["dtype"]), Weights()

    def case(proj, n, k, scheme, T):
        return quant_case(proj, n, k, scheme, T, dtype, check.device, check.timer, copy_bps, weights)

    try:
        return check._cases("quant", case, quant_grid(check.plan))
    finally:
        weights.__init__()


def quant_goals(report: dict) -> dict:
    """The quant part's goals: every case within tolerance; W4A16 decode (T <= 16) faster than
    the bf16 matmul on every projection (judged on a GPU only)."""
    part = report.get("quant") or {}
    cases, crashed = part.get("cases", []), len(part.get("failed", []))
    bad = len([c for c in cases if not c["ok"]]) + crashed
    return {"quant_within_tolerance": {
        "target": "kernel err <= max(2 x the bf16 matmul's err, 2 eps max|ref|), ref: fp32 "
                  "x the dequantized weight", "checked": len(cases), "failed": bad,
        "pass": not bad if cases or crashed else None, "skipped_cases": part.get("skipped", 0)},
        "quant_w4a16_decode_vs_bf16": _speed_goal(cases, report["dry_run"])}  # fmt: skip


def _speed_goal(cases: list[dict], dry_run: bool) -> dict:
    """Judged on the eager times (what a step pays, launches included)."""
    w4 = [c for c in cases if c["bits"] == 4 and c["T"] <= DECODE_T]
    w8 = [c for c in cases if c["bits"] == 8 and c["T"] <= DECODE_T]
    worst = min(w4, key=lambda c: c["speedup_vs_torch"]) if w4 else None
    return {
        "target": f"W4A16 (g128) faster than the {w4[0]['dtype'] if w4 else 'bf16'} matmul on "
                  f"every projection at T <= {DECODE_T}",
        "cases": len(w4),
        "min_speedup_w4": worst["speedup_vs_torch"] if worst else None,
        "worst": f"{worst['proj']} T={worst['T']}" if worst else None,
        "min_speedup_w8": min((c["speedup_vs_torch"] for c in w8), default=None),
        "min_speedup_w4_graph": min((c["speedup_graph"] for c in w4 if c.get("speedup_graph")),
                                    default=None),  # GPU time alone: informative, not judged
        "pass": (worst["speedup_vs_torch"] > 1.0) if worst and not dry_run else None,
    }  # fmt: skip


def print_quant(report: dict) -> None:
    """The quant rows of the summary table."""
    cases = (report.get("quant") or {}).get("cases", [])
    if cases:
        print(f"{'quant':24} {'T':>5} {'err/tol':>7} {'us':>9} {'torch us':>9} {'x torch':>7} "
              f"{'bw':>5} {'bw torch':>8} {'graph us':>9} {'x torch':>7}")
    for c in cases:
        print(f"{c['scheme']:13} {c['proj']:4} {c['N']:>5}x{c['K']:<5} {c['T']:5} "
              f"{c['err'] / c['tol']:7.2f} {c['s'] * 1e6:9.1f} {c['s_torch'] * 1e6:9.1f} "
              f"{c['speedup_vs_torch']:7.2f} {c['bw_frac']:5.2f} {c['bw_frac_torch']:8.2f} "
              + (f"{c['s_graph'] * 1e6:9.1f} {c['speedup_graph']:7.2f}" if c.get("speedup_graph")
                 else f"{'-':>9} {'-':>7}"))
