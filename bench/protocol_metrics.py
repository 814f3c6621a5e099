"""Scrape latency of the protocol metrics listener (``--protocol-metrics-port``) while
the engine is busy, against the server's own ``/metrics`` under the same load, same run.

An endpoint picker polls every model server every 50 ms and needs the answer in well
under 10 ms. A scraper in its own process (as the picker is) polls every
``--interval`` seconds over one kept-alive connection and records each answer's
latency, in three phases of ``--seconds`` each on one live server (uvicorn in this
process over a tiny random model or the default model, ``--adapters`` adapters):

1. ``listener_idle``: the listener, no traffic;
2. ``listener_busy``: the listener while ``--streams`` streaming completions over the
   adapters and the base model keep the engine busy (closed loop);
3. ``server_metrics_busy``: the server's ``/metrics`` (admin key) under the same load:
   what a scrape of the server's own event loop, which asks the engine thread for its
   residency, costs.

Reports p50 / p99 / max per phase, tokens/s of the load, and the ratios
``server_metrics_busy p99 / listener_busy p99`` and ``listener_busy p99 / listener_idle
p99``. Writes bench/results/protocol_metrics.json and .png.

    python -m bench.protocol_metrics [--seconds 20] [--streams 8] [--model default]
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

from bench.common import RESULTS, ROOT, module_command, write_json

# the test helpers (tests/support: engine, registry and server makers) are not in the wheel
from bench.source_tree import load_test_support

ADMIN_KEY = "bench-admin-key"


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, max(0, round(q / 100 * (len(values) - 1))))]


# --- the scraper (a child process, like the picker) ---------------------------------------
def scraper(url: str, seconds: float, interval: float, key: str | None) -> None:
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=10)
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    latencies, errors = [], 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        start = time.perf_counter()
        try:
            conn.request("GET", parts.path, headers=headers)
            r = conn.getresponse()
            r.read()
            if r.status != 200:
                errors += 1
        except (OSError, http.client.HTTPException):
            errors += 1
            conn.close()
            conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=10)
        latencies.append((time.perf_counter() - start) * 1000)
        time.sleep(max(0.0, interval - (time.perf_counter() - start)))
    print(json.dumps({"ms": latencies, "errors": errors}))


def scrape(url: str, seconds: float, interval: float, key: str | None = None) -> dict:
    out = subprocess.run(
        module_command("protocol_metrics", "--scraper", url, "--seconds", str(seconds),
                       "--interval", str(interval), *(["--key", key] if key else [])),
        cwd=ROOT, capture_output=True, text=True, check=True, timeout=seconds + 60)
    data = json.loads(out.stdout)
    ms = data["ms"]
    return {"scrapes": len(ms), "errors": data["errors"], "p50_ms": percentile(ms, 50),
            "p99_ms": percentile(ms, 99), "max_ms": max(ms), "ms": ms}


# --- the load -----------------------------------------------------------------------------
class Load:
    """``streams`` closed-loop streaming completions in a thread of their own."""

    def __init__(self, url: str, key: str, models: list[str], streams: int, tokens: int) -> None:
        self.url, self.key, self.models = url, key, models
        self.streams, self.tokens_each = streams, tokens
        self.tokens = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)

    async def _one(self, client, i: int) -> None:
        import httpx

        while not self._stop.is_set():
            body = {"model": self.models[i % len(self.models)], "stream": True, "temperature": 0,
                    "prompt": f"request {i}: tell me a long story about number {i}",
                    "max_tokens": self.tokens_each, "ignore_eos": True}
            try:
                async with client.stream("POST", "/v1/completions", json=body) as r:
                    async for line in r.aiter_lines():
                        if line.startswith("data: {"):
                            self.tokens += 1
            except httpx.HTTPError:
                await asyncio.sleep(0.1)
            i += self.streams

    async def _main(self) -> None:
        import httpx

        async with httpx.AsyncClient(base_url=self.url, timeout=120,
                                     headers={"Authorization": f"Bearer {self.key}"}) as c:
            await asyncio.gather(*(self._one(c, i) for i in range(self.streams)))

    def __enter__(self) -> Load:
        self._thread.start()
        time.sleep(1.0)  # the batch fills
        self.started, self.start_tokens = time.monotonic(), self.tokens
        return self

    def __exit__(self, *exc) -> None:
        self.seconds = time.monotonic() - self.started
        self.tokens_per_s = (self.tokens - self.start_tokens) / self.seconds
        self._stop.set()
        self._thread.join(timeout=120)


# --- the run --------------------------------------------------------------------------------
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--interval", type=float, default=0.05)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--adapters", type=int, default=4)
    ap.add_argument("--max-loras", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--model", choices=("tiny", "default"), default="tiny")
    ap.add_argument("--scraper", help=argparse.SUPPRESS)
    ap.add_argument("--key", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.scraper:
        scraper(args.scraper, args.seconds, args.interval, args.key)
        return

    write_random_adapter = load_test_support("adapters").write_random_adapter
    settings = load_test_support("platform_settings").settings
    _server = load_test_support("server")
    free_port = _server.free_port
    make_engine = _server.make_engine
    make_registry = _server.make_registry
    serve_in_thread = _server.serve_in_thread
    from loramux.engine.default_model import default_model_path
    from loramux.platform.app import create_app
    from loramux.platform.state import close_state

    work = Path(tempfile.mkdtemp(prefix="bench-protocol-"))
    if args.model == "tiny":
        make_tiny_llama = load_test_support("tiny_models").make_tiny_llama
        model = make_tiny_llama(work / "tiny", default_model_path())
    else:
        model = default_model_path()
    engine = make_engine(model, max_model_len=512, max_num_seqs=max(16, args.streams),
                         max_loras=args.max_loras, max_cpu_loras=args.adapters)
    registry = make_registry(work / "registry", model, max_lora_rank=16)
    tenant, key = registry.create_tenant("bench")
    names = [f"lora-{i}" for i in range(args.adapters)]
    for i, name in enumerate(names):
        registry.upload(tenant.id, name, write_random_adapter(model, work / name, seed=i, std=0.02))
    port = free_port()
    app = create_app(settings(protocol_metrics_port=port, admin_key=ADMIN_KEY), engine=engine,
                     registry=registry)
    listener = f"http://127.0.0.1:{port}/metrics"
    results: dict = {}
    try:
        with serve_in_thread(app) as url:
            time.sleep(0.5)
            results["listener_idle"] = scrape(listener, args.seconds, args.interval)
            models = [*names, "tiny"]
            with Load(url, key, models, args.streams, args.new_tokens) as load:
                results["listener_busy"] = scrape(listener, args.seconds, args.interval)
            results["listener_busy"]["load_tokens_per_s"] = load.tokens_per_s
            with Load(url, key, models, args.streams, args.new_tokens) as load:
                results["server_metrics_busy"] = scrape(f"{url}/metrics", args.seconds,
                                                        args.interval, ADMIN_KEY)
            results["server_metrics_busy"]["load_tokens_per_s"] = load.tokens_per_s
    finally:
        close_state(app.services)
        engine.shutdown()
        registry.db.dispose()
    busy, idle, server = (results[k]["p99_ms"] for k in
                          ("listener_busy", "listener_idle", "server_metrics_busy"))
    summary = {k: {m: v for m, v in r.items() if m != "ms"} for k, r in results.items()}
    ratios = {"server_metrics_busy_p99_over_listener_busy_p99": server / busy,
              "listener_busy_p99_over_listener_idle_p99": busy / idle}
    path = write_json("protocol_metrics", {
        "config": {k: getattr(args, k) for k in ("seconds", "interval", "streams", "adapters",
                                                 "max_loras", "new_tokens", "model")},
        "phases": summary, "ratios": ratios,
        "goal": "listener_busy p99 well under 10 ms",
    })
    plot(results, RESULTS / "protocol_metrics.png")
    print(json.dumps({"phases": summary, "ratios": ratios}, indent=2))
    print(f"wrote {path}")


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, r in results.items():
        ms = sorted(r["ms"])
        ax.plot(ms, [i / len(ms) for i in range(1, len(ms) + 1)],
                label=f"{name} (p99 {r['p99_ms']:.1f} ms)")
    ax.set_xscale("log")
    ax.axvline(10, color="grey", linestyle=":", label="10 ms")
    ax.set_xlabel("scrape latency (ms)")
    ax.set_ylabel("fraction of scrapes")
    ax.set_title("protocol metrics listener vs the server's /metrics, engine busy")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
