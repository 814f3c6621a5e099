"""The CUDA path, proven by one command on a GPU: every Triton kernel and the engine end
to end against torch, with the goals recorded pass/fail (issue 20).

Parts, in the order they run (each writes the JSON as it ends, so a cut run keeps them):
1. ``copy``: device-to-device copy rate, the bandwidth ceiling (bytes read + written).
2. ``sgmv``: Triton shrink/expand vs a float32 torch reference (``tests/support``) and the
   torch backend in the same dtype: bf16 then fp16, decode (T=64) and prefill (T=1024)
   shapes, ranks 8-64, 1-64 distinct adapters, Llama-7B qkv and down projections;
   error, time, bandwidth as a fraction of the copy rate.
3. ``attention``: Triton paged attention vs ``scaled_dot_product_attention`` on the same
   contexts (decode; a prompt chunk over a cached prefix), MHA d128 and GQA d64.
4. ``quant``: Triton W4A16 / W8A16 GEMMs on Llama-7B projections vs bf16 (``gpu_check_quant``).
5. ``greedy``: greedy outputs of the device path vs the torch path (CPU) on a tiny random
   model, base rows mixed with two adapters, checked by teacher forcing.
6. ``engine``: random Llama-7B- then 1B-shaped models (bf16, fixed seed, drawn on the
   device, loaded from a folder like any model): decode tokens/s of a 64-row batch for the
   base model and for 1, 8, 32 distinct rank-16 adapters; ratio base ÷ LoRA.

Goals (evaluated on a GPU only): SGMV >= 60% of the copy rate on bf16 decode shapes that move
>= 32 MiB (below that a launch's fixed cost, not bandwidth, sets the time); 32 distinct r16
adapters in a 64-row batch on the 7B shape <= 15% slower than the base model; every kernel
within bf16 tolerance (``gpu_check_kernels``); greedy outputs agree; W4A16 decode (T <= 16)
faster than the bf16 matmul on every projection.

Runs from the repository root with the machine's own ``python3`` (no install: see
``source_tree.py``) in about 8 minutes on an H200, cases past ``--budget-s`` skipped:

    python3 -m bench.gpu_check [--out bench/results/gpu_check.json] [--parts ...]
    python3 -m bench.gpu_check --dry-run   # CPU, toy sizes, Triton interpreted (CI)
    python3 -m bench.gpu_check --tensor-parallel-size 2   # greedy and engine parts over 2 GPUs
    make gpu-check

On a lent machine (device tool): ``PYTHONUNBUFFERED=1 python3 -m bench.gpu_check --out
"$OUT/gpu_check.json"`` with a 560 s timeout, then copy the JSON to bench/results/ and commit.
Nothing needs carrying: the engine imports only torch, triton, transformers, tokenizers,
safetensors, numpy, tqdm (and peft for the greedy reference), all in that machine's image.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

from bench.gpu_check_quant import QUANT_DRY, QUANT_GPU, print_quant, quant_goals, quant_part

T_START = time.monotonic()  # the budget counts the imports too
BENCH = Path(__file__).resolve().parent
RESULTS = BENCH / "results"
PARTS = ("copy", "sgmv", "attention", "quant", "greedy", "engine")
BW_GOAL, BW_MIN_BYTES, OVERHEAD_GOAL = 0.6, 32 << 20, 1.15

GPU_PLAN = dict(
    budget_s=450, copy_bytes=1 << 30, dtypes=("bfloat16", "float16"),
    projections={"qkv": (4096, (4096, 4096, 4096)), "down": (11008, (4096,))},
    sgmv_modes={"decode": (64, (1, 8, 32, 64)), "prefill": (1024, (1, 8, 64))},
    ranks=(8, 16, 32, 64),
    attn_heads=((32, 32, 128), (32, 8, 64)),
    attn_cases={"decode": (64, 2048, 1), "chunk": (4, 2048, 512)},
    shapes=("7b", "1b"), model_dtype="bfloat16", lora_rank=16,
    engine=dict(batch=64, prompt_len=128, new_tokens=64, reps=2, counts=(0, 1, 8, 32)),
    engine_need_s={"7b": 150, "1b": 70},
    greedy=dict(prompt_lens=[7, 16, 23, 31, 40, 64], new_tokens=24),
    quant=QUANT_GPU,
    ends={"sgmv": 0.38, "attention": 0.46, "quant": 0.55, "greedy": 0.60},  # fraction of the budget
)  # fmt: skip
DRY_PLAN = dict(
    GPU_PLAN, budget_s=600, copy_bytes=8 << 20, dtypes=("float32", "float16"),
    projections={"qkv": (64, (64, 32, 32)), "down": (96, (64,))},
    sgmv_modes={"decode": (6, (3,)), "prefill": (40, (1, 3))}, ranks=(8,),
    attn_heads=((4, 2, 16),), attn_cases={"decode": (3, 37, 1), "chunk": (2, 20, 12)},
    model_dtype="float32", lora_rank=8,
    engine=dict(batch=8, prompt_len=8, new_tokens=4, reps=1, counts=(0, 1, 2, 4)),
    engine_need_s={"7b": 0, "1b": 0},
    greedy=dict(prompt_lens=[5, 17, 33], new_tokens=6),
    quant=QUANT_DRY,
)  # fmt: skip


def _versions() -> dict:
    import torch

    out = {"python": platform.python_version(), "torch": torch.__version__}
    for name in ("triton", "transformers", "peft"):
        try:
            out[name] = __import__(name).__version__
        except ImportError:
            out[name] = None
    try:
        out["commit"] = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=BENCH, capture_output=True, text=True, timeout=10
        ).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        out["commit"] = None
    return out


class Check:
    """Runs the parts in order within the time budget; the report is written after each."""

    def __init__(self, args, plan: dict) -> None:
        import torch

        from bench.gpu_check_kernels import Timer

        self.args, self.plan = args, plan
        self.t0 = T_START
        self.budget = args.budget_s or plan["budget_s"]
        self.device = torch.device("cpu" if args.dry_run else "cuda")
        self.timer = Timer(self.device)
        self.dtype = {n: getattr(torch, n) for n in plan["dtypes"]}
        self.report = {"dry_run": args.dry_run, "device": _device_name(self.device),
                       "tensor_parallel_size": args.tensor_parallel_size,
                       "versions": _versions(), "budget_s": self.budget, "part_s": {}, "errors": {}}  # fmt: skip

    def left(self) -> float:
        return self.budget - (time.monotonic() - self.t0)

    def until(self, part: str) -> float:
        return self.t0 + self.plan["ends"][part] * self.budget

    def save(self) -> None:
        self.report["wall_s"] = time.monotonic() - self.t0
        self.report["goals"] = goals(self.report)
        self.args.out.parent.mkdir(parents=True, exist_ok=True)
        self.args.out.write_text(json.dumps(self.report, indent=1) + "\n")

    def run(self, parts: list[str]) -> None:
        for part in parts:
            t = time.monotonic()
            print(f"[gpu_check] {part} ... ({self.left():.0f} s left)", flush=True)
            try:
                self.report[part] = getattr(self, part)()
            except Exception:  # record, go on with the next part
                self.report["errors"][part] = traceback.format_exc()[-3000:]
                print(self.report["errors"][part], file=sys.stderr, flush=True)
            self.report["part_s"][part] = time.monotonic() - t
            self.save()

    def copy(self) -> dict:
        from bench.gpu_check_kernels import copy_rate

        return copy_rate(self.device, self.plan["copy_bytes"], self.timer)

    def _cases(self, part: str, fn, grid) -> dict:
        """``fn(*args)`` for every args of ``grid`` until the part's share of the budget is
        spent; a case that raises is recorded (``error``) and the others still run."""
        cases, skipped, failed, end = [], 0, [], self.until(part)
        for args in grid:
            if time.monotonic() > end:
                skipped += 1
                continue
            try:
                cases.append(fn(*args))
            except Exception:
                failed.append({"case": repr(args), "error": traceback.format_exc()[-1500:]})
                print(failed[-1]["error"], file=sys.stderr, flush=True)
        if failed:
            self.report["errors"][part] = f"{len(failed)} case(s) failed; first: {failed[0]}"
        return {"cases": cases, "skipped": skipped, "failed": failed}

    def sgmv(self) -> dict:
        from bench.gpu_check_kernels import sgmv_case

        copy_bps = (self.report.get("copy") or {}).get("bytes_per_s") or float("nan")
        p = self.plan
        grid = [
            (proj, K, widths, T, rank, n, dtype, mode)
            for dtype in self.dtype.values()
            for mode, (T, counts) in p["sgmv_modes"].items()
            for proj, (K, widths) in p["projections"].items()
            for rank in p["ranks"]
            for n in counts
        ]

        def case(proj, K, widths, T, rank, n, dtype, mode):
            return sgmv_case(proj, K, widths, T, rank, n, dtype, self.device, self.timer,
                             copy_bps, mode=mode)  # fmt: skip

        return self._cases("sgmv", case, grid)

    def attention(self) -> dict:
        from bench.gpu_check_kernels import attention_case

        grid = [
            (mode, heads, kv, d, batch, prefix, chunk, dtype, self.device, self.timer)
            for dtype in self.dtype.values()
            for heads, kv, d in self.plan["attn_heads"]
            for mode, (batch, prefix, chunk) in self.plan["attn_cases"].items()
        ]
        return self._cases("attention", attention_case, grid)

    def quant(self) -> dict:
        return quant_part(self)

    def greedy(self) -> dict:
        import shutil

        import torch

        from bench.gpu_check_engine import (
            TINY,
            greedy_check,
            random_prompts,
            scratch_dir,
            write_random_adapters,
            write_random_llama,
        )

        work = scratch_dir(64 << 20)
        try:
            cfg = write_random_llama(work / "tiny", TINY, torch.float32, self.device, std=0.08)
            adapters = write_random_adapters(
                work / "adapters", cfg, 2, 8, torch.float32, self.device, std_b=0.05
            )
            g = self.plan["greedy"]
            prompts = random_prompts(0, g["prompt_lens"], TINY["vocab_size"], seed=2)
            return greedy_check(work / "tiny", adapters, device=self.device, lora_backend="triton",
                                prompts=prompts, new_tokens=g["new_tokens"],
                                tensor_parallel_size=self.args.tensor_parallel_size)  # fmt: skip
        finally:
            shutil.rmtree(work, ignore_errors=True)

    def engine(self) -> dict:
        out = self.report["engine"] = {}
        for shape in self.plan["shapes"]:
            need = self.plan["engine_need_s"][shape]
            if self.left() < need:
                out[shape] = {"skipped": f"{self.left():.0f} s left of the budget, {need} s needed"}
                continue
            try:
                out[shape] = self.engine_shape(shape)
            except Exception:
                self.report["errors"][f"engine_{shape}"] = traceback.format_exc()[-3000:]
                print(self.report["errors"][f"engine_{shape}"], file=sys.stderr, flush=True)
            self.save()
        return out

    def engine_shape(self, name: str) -> dict:
        import shutil

        import torch

        from bench.gpu_check_engine import (
            COMMON,
            SHAPES,
            TOY_SHAPES,
            adapter_bytes,
            engine_throughput,
            param_shapes,
            scratch_dir,
            write_random_adapters,
            write_random_llama,
        )

        shape = (TOY_SHAPES if self.args.dry_run else SHAPES)[name]
        e, rank = self.plan["engine"], self.plan["lora_rank"]
        dtype = getattr(torch, self.plan["model_dtype"])
        cfg = dict(COMMON, **shape)
        numel = sum(torch.Size(s).numel() for _, s in param_shapes(cfg))
        nbytes = numel * dtype.itemsize
        work = scratch_dir(nbytes + max(e["counts"]) * adapter_bytes(cfg, rank, dtype))
        try:
            t = time.monotonic()
            cfg = write_random_llama(work / "model", shape, dtype, self.device)
            adapters = write_random_adapters(
                work / "adapters", cfg, max(e["counts"]), rank, dtype, self.device
            )
            build_s = time.monotonic() - t
            res = engine_throughput(
                work / "model", adapters, e["counts"], device=self.device,
                dtype=self.plan["model_dtype"], batch=e["batch"], prompt_len=e["prompt_len"],
                new_tokens=e["new_tokens"], reps=e["reps"], rank=rank, vocab=cfg["vocab_size"],
                tensor_parallel_size=self.args.tensor_parallel_size,
            )  # fmt: skip
        finally:
            shutil.rmtree(work, ignore_errors=True)
        return {"params": numel, "weight_bytes": nbytes, "build_s": build_s, **res}


def _device_name(device) -> str:
    import torch

    return torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"


def goals(report: dict) -> dict:
    """The issue's goals from what the report holds (None = not measured / not on a GPU)."""
    gpu = not report["dry_run"]
    sgmv = (report.get("sgmv") or {}).get("cases", [])
    checks = [c[op] for c in sgmv for op in ("shrink", "expand")]
    checks += (report.get("attention") or {}).get("cases", [])
    crashed = sum(len((report.get(p) or {}).get("failed", [])) for p in ("sgmv", "attention"))
    bad = len([c for c in checks if not c["ok"]]) + crashed
    out = {"kernels_within_tolerance": {
        "target": "err <= max(2 x torch's err in that dtype, 2 eps(dtype) max|ref|)",
        "checked": len(checks), "failed": bad, "pass": not bad if checks or crashed else None,
        "skipped_cases": sum((report.get(p) or {}).get("skipped", 0) for p in ("sgmv", "attention"))}}
    bw = [(c[op]["bw_frac"], f"{c['proj']} {op} r{c['rank']} x{c['adapters']}")
          for c in sgmv for op in ("shrink", "expand")
          if c["mode"] == "decode" and c["dtype"] == "bfloat16" and c[op]["bytes"] >= BW_MIN_BYTES]
    out["sgmv_decode_bandwidth"] = {
        "target": f">= {BW_GOAL} of the copy rate, bf16 decode cases moving >= 32 MiB",
        "cases": len(bw), "min": min(bw)[0] if bw else None, "worst": min(bw)[1] if bw else None,
        "median": statistics.median(f for f, _ in bw) if bw else None,
        "pass": (min(bw)[0] >= BW_GOAL) if bw and gpu else None}
    rows = ((report.get("engine") or {}).get("7b") or {}).get("results") or {}
    top = rows.get(str(max((int(k) for k in rows), default=0)))
    ratio = top["slowdown_vs_base"] if top and top["adapters"] else None
    out["lora_overhead_7b"] = {
        "target": f"base ÷ LoRA decode tok/s <= {OVERHEAD_GOAL} (32 distinct r16, 64 rows)",
        "adapters": top["adapters"] if top else None, "value": ratio,
        "pass": (ratio <= OVERHEAD_GOAL) if ratio is not None and gpu else None}
    out.update(quant_goals(report))
    greedy = report.get("greedy") or {}
    out["greedy_device_vs_torch"] = {"target": "every token an argmax within TIE_TOL; paths part only at ties",
                                     "pass": greedy.get("ok")}  # fmt: skip
    return out


def print_table(report: dict) -> None:
    """The short summary printed last (the device tool returns the end of the output)."""
    print(f"\n== gpu_check on {report['device']} (dry run: {report['dry_run']}), {report['wall_s']:.0f} s")
    if report.get("copy"):
        print(f"copy rate {report['copy']['bytes_per_s'] / 1e9:.0f} GB/s (read + write)")
    groups: dict[tuple, list] = {}
    for c in (report.get("sgmv") or {}).get("cases", []):
        for op in ("shrink", "expand"):
            groups.setdefault((c["dtype"], c["mode"], c["proj"], op), []).append(c[op])
    if groups:
        print(f"{'sgmv':28} {'cases':>5} {'worst err/tol':>13} {'bw min/med/max':>17} {'x torch med':>11}")
    for (dt, mode, proj, op), cs in groups.items():
        bw = sorted(x["bw_frac"] for x in cs)
        print(f"{dt:9} {mode:7} {proj:4} {op:6} {len(cs):5} {max(x['err'] / x['tol'] for x in cs):13.2f} "
              f"{bw[0]:5.2f}/{statistics.median(bw):4.2f}/{bw[-1]:4.2f} "
              f"{statistics.median(x['speedup_vs_torch'] for x in cs):11.2f}")
    for c in (report.get("attention") or {}).get("cases", []):
        print(f"attn {c['dtype']:9} {c['mode']:6} H{c['heads']}/{c['kv_heads']} d{c['head_dim']} "
              f"B{c['batch']} ctx{c['prefix'] + c['new']}: err {c['err']:.1e} (tol {c['tol']:.1e}) "
              f"{c['s'] * 1e6:8.1f} us, SDPA {c['s_sdpa'] * 1e6:8.1f} us")
    print_quant(report)
    g = report.get("greedy") or {}
    if g:
        print(f"greedy device vs torch: {g['identical']}/{g['sequences']} identical, ok={g['ok']}")
    for shape, e in (report.get("engine") or {}).items():
        if "results" not in e:
            print(f"engine {shape}: {e}")
            continue
        cells = ", ".join(f"{r['adapters']}: {r['decode_tok_s']:.0f} tok/s x{r['slowdown_vs_base']:.2f}"
                          for r in e["results"].values())
        print(f"engine {shape} (build {e['build_s']:.0f} s, init {e['init_s']:.0f} s): {cells}")
    for name, goal in report["goals"].items():
        shown = {k: v for k, v in goal.items() if k not in ("target", "pass")}
        print(f"GOAL {name}: {'n/a' if goal['pass'] is None else 'PASS' if goal['pass'] else 'FAIL'}"
              f" {shown}  [{goal['target']}]")
    for part, err in report["errors"].items():
        print(f"ERROR in {part}: {err.strip().splitlines()[-1]}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry-run", action="store_true",
                   help="every part at toy sizes on the CPU, Triton interpreted (fp32/fp16)")
    p.add_argument("--out", type=Path, default=None,
                   help="JSON path (default bench/results/gpu_check.json; _dry_run.json with --dry-run)")
    p.add_argument("--budget-s", type=float, default=None, help="time budget (GPU default 450 s)")
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {PARTS}")
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="the greedy and engine parts' device path sharded over this many devices")
    args = p.parse_args(argv)
    if args.tensor_parallel_size < 1:
        p.error("--tensor-parallel-size must be >= 1")
    parts = [x for x in args.parts.split(",") if x]
    if unknown := set(parts) - set(PARTS):
        p.error(f"unknown parts {sorted(unknown)}; choose from {PARTS}")
    if {"sgmv", "quant"} & set(parts) and "copy" not in parts:
        parts.insert(0, "copy")  # the bandwidth fractions need the copy rate
    parts.sort(key=PARTS.index)
    if args.out is None:
        args.out = RESULTS / ("gpu_check_dry_run.json" if args.dry_run else "gpu_check.json")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # local folders only; the GPU machine has no network
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is first imported
    from bench.source_tree import use_source_tree

    source = use_source_tree()
    import torch

    if not args.dry_run and not torch.cuda.is_available():
        p.error("no CUDA device here: run with --dry-run on the CPU")
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 references stay fp32
    check = Check(args, DRY_PLAN if args.dry_run else GPU_PLAN)
    check.report["loramux_from"] = source
    check.run(parts)
    print_table(check.report)
    print(f"wrote {args.out}")
    return 1 if check.report["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
