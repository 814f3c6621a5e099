"""HTTP load on loopback vs the offline engine, same run, same machine.

Workload: requests over 8 LoRA adapters and the base model (request i uses adapter
i mod 9, the 9th being the base model), text prompts of ``--prompt-len`` tokens,
``--new-tokens`` generated each (greedy, ``ignore_eos``).

1. Offline: ``loramux.engine.LLM`` runs all requests with ``max_num_seqs`` = the
   highest concurrency level → tokens/s (after one warm-up pass).
2. Server: the same engine config behind ``create_app`` under uvicorn in a child
   process (adapters as ``--lora-modules``). An asyncio + httpx client streams
   requests at each concurrency level (closed loop, bounded by ``--requests`` and
   ``--level-seconds``; one warm-up pass first) → requests/s, time to first token
   p50/p99, time per output token, tokens/s.
3. HTTP overhead ratio = HTTP tokens/s at the highest level / offline tokens/s, from
   ``--repeat`` alternating offline/HTTP pairs (median), so a shared machine's changing
   load hits both sides alike (goal >= 0.9). Writes bench/results/serve_load.json and
   serve_load.png.

    python -m bench.serve_load                       # default model, bfloat16, 1 thread each
    python -m bench.serve_load --quick               # a tiny random model: seconds
    python -m bench.serve_load --concurrency 1,8,32 --requests 64 --new-tokens 32
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

# the test helpers (tests/support: engine, registry and server makers) are not in the wheel
from bench.common import RESULTS, ROOT, bench_parser, make_prompts, module_command, write_json
from bench.source_tree import load_test_support

BASE = "base"


def adapter_names(n: int) -> list[str]:
    return [f"lora-{i}" for i in range(n)]


def model_for(i: int, names: list[str]) -> str:
    k = i % (len(names) + 1)
    return names[k] if k < len(names) else BASE


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    k = min(len(values) - 1, max(0, round(q / 100 * (len(values) - 1))))
    return values[k]


# --- setup ---------------------------------------------------------------------------------
def prepare(args, work: Path) -> dict:
    """Model folder, adapter folders and prompts shared by both runs."""
    write_random_adapter = load_test_support("adapters").write_random_adapter
    from transformers import AutoTokenizer

    from loramux.engine.default_model import default_model_path

    if args.quick:
        make_tiny_llama = load_test_support("tiny_models").make_tiny_llama
        model = make_tiny_llama(work / "tiny", default_model_path())
    else:
        model = Path(args.model) if args.model else default_model_path()
    names = adapter_names(args.adapters)
    adapters = {n: str(write_random_adapter(model, work / n, seed=10 + i, std=0.02, r=args.rank))
                for i, n in enumerate(names)}
    tok = AutoTokenizer.from_pretrained(model)
    prompts = [tok.decode(p) for p in make_prompts(tok, args.requests, args.prompt_len)]
    return {"model": str(model), "adapters": adapters, "prompts": prompts, "names": names}


def engine_kwargs(args, max_num_seqs: int) -> dict:
    return dict(dtype=args.dtype, device=args.device, max_model_len=args.prompt_len * 2 + args.new_tokens + 64,
                max_num_seqs=max_num_seqs, enable_lora=True, max_loras=args.max_loras,
                max_lora_rank=max(16, args.rank), max_cpu_loras=max(args.adapters, args.max_loras))


# --- offline ---------------------------------------------------------------------------------
class Offline:
    """The offline engine on the same workload (``max_num_seqs`` = the highest level)."""

    def __init__(self, args, setup: dict, max_num_seqs: int) -> None:
        from loramux.engine import LLM, LoRARequest, SamplingParams

        self.llm = LLM(setup["model"], **engine_kwargs(args, max_num_seqs))
        names = setup["names"]
        loras = {n: LoRARequest(n, i + 1, p) for i, (n, p) in enumerate(setup["adapters"].items())}
        self.prompts = setup["prompts"]
        self.loras = [None if model_for(i, names) == BASE else loras[model_for(i, names)]
                      for i in range(len(self.prompts))]
        self.params = SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True)
        self.run()  # warm-up: adapter loads, per-shape kernel setup

    def run(self) -> dict:
        t0 = time.perf_counter()
        outs = self.llm.generate(self.prompts, self.params, lora_request=self.loras)
        secs = time.perf_counter() - t0
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        n = len(self.prompts)
        return {"requests": n, "tokens": tokens, "seconds": secs, "tokens_per_s": tokens / secs,
                "requests_per_s": n / secs}


# --- server child ------------------------------------------------------------------------------
def child(config_path: str) -> None:
    import uvicorn
    make_engine = load_test_support("server").make_engine
    from loramux.platform.app import create_app
    from loramux.platform.logs import configure_logging
    from loramux.platform.settings import Settings

    cfg = json.loads(Path(config_path).read_text())
    torch.set_num_threads(cfg["threads"])
    configure_logging("warning", "json")
    kw = cfg["engine"]
    engine = make_engine(cfg["model"], max_model_len=kw["max_model_len"],
                         max_num_seqs=kw["max_num_seqs"], max_waiting=4096,
                         max_loras=kw["max_loras"], max_lora_rank=kw["max_lora_rank"],
                         max_cpu_loras=kw["max_cpu_loras"], dtype=kw["dtype"], device=kw["device"])
    settings = Settings(served_model_name=[BASE], allow_anonymous=True, log_level="warning",
                        lora_modules=[f"{n}={p}" for n, p in cfg["adapters"].items()])
    app = create_app(settings, engine=engine)
    uvicorn.run(app, host="127.0.0.1", port=cfg["port"], log_config=None, access_log=False,
                log_level="warning")


def start_server(args, setup: dict, work: Path, max_num_seqs: int):
    free_port = load_test_support("server").free_port
    port = free_port()
    kw = engine_kwargs(args, max_num_seqs)
    cfg = {"model": setup["model"], "adapters": setup["adapters"], "port": port,
           "threads": args.threads, "engine": kw}
    cfg_path = work / "server.json"
    cfg_path.write_text(json.dumps(cfg))
    log = open(work / "server.log", "w")  # noqa: SIM115
    proc = subprocess.Popen(module_command("serve_load", "--child", str(cfg_path)), cwd=ROOT,
                            stdout=log, stderr=subprocess.STDOUT, env={**os.environ})
    import httpx

    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited; see {work / 'server.log'}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise TimeoutError("the server did not start")


# --- load ---------------------------------------------------------------------------------------
async def one_request(client, body: dict) -> dict:
    t0 = time.perf_counter()
    ttft = None
    tokens = 0
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            return {"ok": False, "status": r.status_code}
        async for line in r.aiter_lines():
            # parse only what is measured (the client shares the machine with the server)
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            if '"choices":[]' in line:
                tokens = json.loads(line[6:])["usage"]["completion_tokens"]
            elif ttft is None and json.loads(line[6:])["choices"][0].get("text"):
                ttft = time.perf_counter() - t0
    e2e = time.perf_counter() - t0
    return {"ok": True, "ttft": ttft if ttft is not None else e2e, "e2e": e2e, "tokens": tokens}


async def run_level(url: str, setup: dict, args, concurrency: int) -> dict:
    import httpx

    names = setup["names"]
    prompts = setup["prompts"]
    n = len(prompts)
    results: list[dict] = []
    next_i = 0
    deadline = time.monotonic() + args.level_seconds

    async def worker(client):
        nonlocal next_i
        while next_i < n and time.monotonic() < deadline:
            i = next_i
            next_i += 1
            body = {"model": model_for(i, names), "prompt": prompts[i], "max_tokens": args.new_tokens,
                    "temperature": 0, "ignore_eos": True, "stream": True,
                    "stream_options": {"include_usage": True}}
            results.append(await one_request(client, body))

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        # warm-up: every adapter once
        await asyncio.gather(*(one_request(client, {"model": m, "prompt": "hi", "max_tokens": 2})
                               for m in [*names, BASE]))
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
        secs = time.perf_counter() - t0
    ok = [r for r in results if r["ok"]]
    tokens = sum(r["tokens"] for r in ok)
    tpot = [(r["e2e"] - r["ttft"]) / max(1, r["tokens"] - 1) for r in ok]
    return {
        "concurrency": concurrency, "requests": len(ok), "failed": len(results) - len(ok),
        "seconds": secs, "requests_per_s": len(ok) / secs, "tokens_per_s": tokens / secs,
        "ttft_p50_s": percentile([r["ttft"] for r in ok], 50),
        "ttft_p99_s": percentile([r["ttft"] for r in ok], 99),
        "tpot_p50_s": percentile(tpot, 50), "e2e_p50_s": percentile([r["e2e"] for r in ok], 50),
        "mean_tokens": statistics.mean([r["tokens"] for r in ok]) if ok else 0,
    }


def plot(levels: list[dict], offline: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    c = [lv["concurrency"] for lv in levels]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    a.plot(c, [lv["ttft_p50_s"] * 1000 for lv in levels], "o-", label="TTFT p50")
    a.plot(c, [lv["ttft_p99_s"] * 1000 for lv in levels], "s--", label="TTFT p99")
    a.plot(c, [lv["tpot_p50_s"] * 1000 for lv in levels], "^-", label="time per output token p50")
    a.set_xscale("log", base=2)
    a.set_yscale("log")
    a.set_xlabel("concurrent requests")
    a.set_ylabel("ms")
    a.set_title("latency vs load")
    a.legend()
    b.plot(c, [lv["tokens_per_s"] for lv in levels], "o-", label="HTTP (loopback)")
    b.axhline(offline["tokens_per_s"], color="gray", linestyle="--",
              label=f"offline engine (max_num_seqs={max(c)})")
    b.set_xscale("log", base=2)
    b.set_xlabel("concurrent requests")
    b.set_ylabel("generated tokens/s")
    b.set_title("throughput, 8 adapters + base")
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = bench_parser(__doc__, threads=1, quick="a tiny random model instead",
                      threads_help="torch threads of each engine (1 leaves a core for HTTP and the "
                                   "client; on a shared machine more threads make OpenMP barriers stall)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--model", help="model folder (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--adapters", type=int, default=8)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--max-loras", type=int, default=8)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--concurrency", default="1,4,16,64")
    ap.add_argument("--repeat", type=int, default=3,
                    help="alternating offline / HTTP pairs at the highest level")
    ap.add_argument("--level-seconds", type=float, default=120.0, help="stop launching after this")
    args = ap.parse_args()
    if args.child:
        child(args.child)
        return
    torch.set_num_threads(args.threads)
    levels_c = sorted(int(x) for x in args.concurrency.split(","))
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="serve-load-") as tmp:
        work = Path(tmp)
        setup = prepare(args, work)
        print(f"model {setup['model']}, {args.adapters} adapters, {args.requests} requests, "
              f"{args.new_tokens} new tokens each, dtype {args.dtype}")
        top = max(levels_c)
        proc, url = start_server(args, setup, work, top)
        levels = []
        pairs = []
        try:
            asyncio.run(run_level(url, setup, args, top))  # server warm-up, not recorded
            offline_engine = Offline(args, setup, top)
            # Offline and HTTP alternate, so both see the same machine (it may be shared);
            # the ratio is the median over the pairs.
            for _ in range(args.repeat):
                off = offline_engine.run()
                http = asyncio.run(run_level(url, setup, args, top))
                pairs.append((off, http, http["tokens_per_s"] / off["tokens_per_s"]))
                print(f"offline {off['tokens_per_s']:8.1f} tok/s | HTTP at {top}: "
                      f"{http['tokens_per_s']:8.1f} tok/s | ratio {pairs[-1][2]:.3f}")
            del offline_engine
            gc.collect()
            for c in levels_c:
                if c == top:
                    lv = max((p[1] for p in pairs), key=lambda t: t["tokens_per_s"])
                else:
                    lv = asyncio.run(run_level(url, setup, args, c))
                levels.append(lv)
                print(f"concurrency {c:3d}: {lv['requests_per_s']:6.2f} req/s  "
                      f"{lv['tokens_per_s']:8.1f} tok/s  TTFT p50 {lv['ttft_p50_s'] * 1000:7.1f} ms  "
                      f"p99 {lv['ttft_p99_s'] * 1000:7.1f} ms  TPOT p50 {lv['tpot_p50_s'] * 1000:6.1f} ms"
                      f"  ({lv['requests']} ok, {lv['failed']} failed)")
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    offline = max((p[0] for p in pairs), key=lambda t: t["tokens_per_s"])
    ratio = statistics.median(p[2] for p in pairs)
    print(f"offline engine: {offline['tokens_per_s']:.1f} tokens/s (best of {len(pairs)})")
    print(f"HTTP overhead ratio at concurrency {levels[-1]['concurrency']}: {ratio:.3f} "
          f"(median of {len(pairs)} alternating pairs; goal >= 0.9)")
    RESULTS.mkdir(parents=True, exist_ok=True)
    png = RESULTS / "serve_load.png"
    plot(levels, offline, png)
    path = write_json("serve_load", {
        "args": vars(args), "offline": offline, "levels": levels, "http_overhead_ratio": ratio,
        "pairs": [{"offline_tokens_per_s": o["tokens_per_s"], "http_tokens_per_s": h["tokens_per_s"],
                   "ratio": r} for o, h, r in pairs],
        "load_average_before": load_before, "load_average_after": os.getloadavg(),
    })
    print(f"wrote {path} and {png}")
    if os.getloadavg()[0] > (os.cpu_count() or 1) * 1.5:
        print("warning: the machine was busy (load average above 1.5x the cores); numbers are noisy")


if __name__ == "__main__":
    main()
