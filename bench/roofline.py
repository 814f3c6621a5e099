"""Roofline of a serving step: the step's measured GEMM time against the best GEMM this CPU does
at the same shapes.

The engine (the default model, ``--dtype``) runs a serving-shaped workload: ``--decode``
sequences decoding while ``--prompt-len``-token prompts arrive and are prefilled beside them
(chunked by the step budget as in serving). ``torch.profiler`` records steps 4.. with their
input shapes; every projection matmul (oneDNN's packed linear, or ``aten::linear`` / ``addmm`` /
``mm``) is grouped by its shape (M rows, K in, N out). Each shape is then timed alone, warm, as
the best of the GEMMs torch offers on this CPU (oneDNN packed for that M, ``F.linear``) and
against its bound: ``max(weight bytes / memory bandwidth, 2 M K N / peak GEMM FLOP/s)``, the
bandwidth from a large copy and the peak from a large packed GEMM, both measured here.

Reports, per shape and in total per step: measured ms, best isolated ms, bound ms, and the
ratios measured ÷ best (what the step loses to its surroundings: cache, threads, layout) and
best ÷ bound (what the GEMM library leaves), plus the GEMMs' share of the step. Writes
bench/results/roofline_<dtype>.json.

    python -m bench.roofline --dtype bfloat16        # ~1 min
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict

import torch
import torch.nn.functional as F

from bench.common import bench_parser, cpu_name, make_engine, make_prompts, setup, write_json

GEMM_OPS = ("mkldnn::_linear_pointwise", "aten::linear", "aten::addmm", "aten::mm")


def _best_ms(fn, reps: int = 20) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * min(times)


def _candidates(m: int, k: int, n: int, dtype: torch.dtype):
    """The GEMMs torch offers here for x [m, k] @ W[n, k]^T, as zero-argument callables."""
    x, w = torch.randn(m, k, dtype=dtype), torch.randn(n, k, dtype=dtype) / k ** 0.5
    out = {"F.linear": lambda: F.linear(x, w)}
    if torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        try:
            packed = torch.ops.mkldnn._reorder_linear_weight(w, m)
            torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
            out["onednn_packed"] = lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
        except RuntimeError:
            pass
    return out


def machine_limits(dtype: torch.dtype) -> dict:
    """Memory bandwidth (GB/s, a 256 MiB copy: bytes read + written) and peak GEMM FLOP/s (the
    best candidate at 512 x 4096 x 4096) measured on this machine now."""
    src = torch.empty(64 << 20, dtype=torch.float32).uniform_()
    dst = torch.empty_like(src)
    copy_ms = _best_ms(lambda: dst.copy_(src), reps=5)
    bandwidth = 2 * src.numel() * 4 / (copy_ms / 1e3) / 1e9
    m, k, n = 512, 4096, 4096
    peak_ms = min(_best_ms(f, reps=3) for f in _candidates(m, k, n, dtype).values())
    return {"bandwidth_gb_s": bandwidth, "peak_gflop_s": 2 * m * k * n / (peak_ms / 1e3) / 1e9}


def step_gemms(model, dtype: str, decode: int, prompt_len: int, tok, steps: int) -> tuple[dict, float, int]:
    """Profile ``steps`` serving steps: {(m, k, n): [calls, total ms]}, total step ms, steps."""
    from loramux.engine.sampling_params import SamplingParams

    eng = make_engine(model=str(model), dtype=dtype, max_model_len=2048, max_num_seqs=64)
    prompts = make_prompts(tok, decode + steps, prompt_len)
    long = SamplingParams(temperature=0, max_tokens=1024, min_tokens=1024, ignore_eos=True)
    for i in range(decode):
        eng.add_request(f"d{i}", {"prompt_token_ids": prompts[i][:16]}, long)
    for _ in range(4):  # the decoders' prompts in, the cost model warm
        eng.step()
    shapes: dict[tuple[int, int, int], list[float]] = defaultdict(lambda: [0, 0.0])
    from torch.profiler import ProfilerActivity, profile

    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        for s in range(steps):
            eng.add_request(f"p{s}", {"prompt_token_ids": prompts[decode + s]}, SamplingParams(max_tokens=1))
            eng.step()
    step_ms = 1e3 * (time.perf_counter() - t0)
    for ev in prof.key_averages(group_by_input_shape=True):
        if ev.key not in GEMM_OPS or not ev.input_shapes or len(ev.input_shapes[0]) != 2:
            continue
        (m, k), wshape = ev.input_shapes[0], ev.input_shapes[1]
        n = wshape[0] if ev.key != "aten::mm" else wshape[1]
        entry = shapes[(m, k, n)]
        entry[0] += ev.count
        entry[1] += ev.cpu_time_total / 1e3  # us -> ms (self + children: the whole GEMM)
    return dict(shapes), step_ms, steps


def main() -> None:
    ap = bench_parser(__doc__)
    ap.add_argument("--decode", type=int, default=16, help="sequences decoding throughout")
    ap.add_argument("--prompt-len", type=int, default=384, help="one new prompt per step")
    ap.add_argument("--steps", type=int, default=8)
    args = ap.parse_args()
    model, tok = setup(args)
    dtype = getattr(torch, args.dtype)
    shapes, step_ms, steps = step_gemms(model, args.dtype, args.decode, args.prompt_len, tok, args.steps)
    limits = machine_limits(dtype)
    rows, tot = [], {"measured_ms": 0.0, "best_ms": 0.0, "bound_ms": 0.0}
    for (m, k, n), (calls, ms) in sorted(shapes.items()):
        per_call = ms / calls
        timings = {name: _best_ms(f) for name, f in _candidates(m, k, n, dtype).items()}
        best = min(timings.values())
        bound = 1e3 * max(n * k * dtype.itemsize / (limits["bandwidth_gb_s"] * 1e9),
                          2 * m * k * n / (limits["peak_gflop_s"] * 1e9))
        rows.append({"m": m, "k": k, "n": n, "calls_per_step": calls / steps, "measured_ms": per_call,
                     "isolated_ms": timings, "best_ms": best, "bound_ms": bound,
                     "measured_vs_best": per_call / best, "best_vs_bound": best / bound})
        for key, v in (("measured_ms", per_call), ("best_ms", best), ("bound_ms", bound)):
            tot[key] += v * calls / steps
    line = {"step_ms": step_ms / steps, "gemm_share_of_step": tot["measured_ms"] / (step_ms / steps),
            **{f"gemm_{k}_per_step": v for k, v in tot.items()},
            "measured_vs_best": tot["measured_ms"] / tot["best_ms"] if tot["best_ms"] else None,
            "measured_vs_bound": tot["measured_ms"] / tot["bound_ms"] if tot["bound_ms"] else None}
    print(f"{cpu_name()} {args.dtype}, {args.threads} threads: bandwidth {limits['bandwidth_gb_s']:.1f} GB/s, "
          f"peak {limits['peak_gflop_s']:.0f} GFLOP/s")
    for r in rows:
        print(f"  M={r['m']:5d} K={r['k']:5d} N={r['n']:5d}  x{r['calls_per_step']:5.1f}/step  measured "
              f"{r['measured_ms']:7.3f} ms  best {r['best_ms']:7.3f}  bound {r['bound_ms']:7.3f}")
    print("per step: " + ", ".join(f"{k} {v:.3f}" for k, v in line.items() if v is not None))
    out = write_json(f"roofline_{args.dtype}", {"cpu": cpu_name(), "dtype": args.dtype, "workload": vars(args),
                                                "machine_limits": limits, "roofline": line, "shapes": rows,
                                                "median_measured_vs_best": statistics.median(
                                                    r["measured_vs_best"] for r in rows) if rows else None})
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
