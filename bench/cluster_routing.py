"""Cluster routing over a simulated engine fleet: affinity ÷ round-robin ÷ least-loaded.

The real router and pool code (``loramux.platform.cluster``) route every request; the
engines are simulated (discrete events), so the run measures the policy, not a GPU:

* 1,000 adapters, popularity Zipf(1.1); 4 engines, ``max_loras=8`` GPU slots each (LRU,
  never evicting an adapter a running request uses), ``max_num_seqs=32``.
* Closed loop: ``--concurrency`` clients (default 1.5 × the fleet's batch capacity) each
  send the next request when the last one finished, so every policy runs saturated and
  tokens/s is the fleet's capacity under that policy.
* Engine step time = fixed + per batched token + per distinct adapter in the batch +
  per adapter loaded into a slot in that step (the load stalls the step).
* Engines publish a heartbeat (running, waiting, resident adapters) every
  ``--heartbeat-ms``; the gateway's pool adds its own in-flight requests in between.

Two kinds of load are counted: *adapter loads* (object store -> an engine's memory,
``--cold-ms``, the expensive one; ``--max-cpu-loras`` per engine) and *GPU slot loads*
(CPU tier -> one of the ``max_loras`` slots). With 32 GPU slots in the whole fleet and
37% of Zipf(1.1) traffic outside the top 32 adapters, slot loads cannot fall 5x under
any policy; what affinity removes is the re-fetching of every adapter on every engine.
Counted after ``--warmup`` (half the requests) so the caches are in steady state.

Reports adapter loads and slot loads per 1,000 requests, output tokens/s, p50/p99 TTFT per policy, and
the ratios (goal: ≥ 5× fewer loads than round-robin, throughput within 10% of
least-loaded); writes ``bench/results/cluster_routing.{json,png}``.
"""

from __future__ import annotations

import argparse
import heapq
import sys
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from bench.common import RESULTS, write_json
from loramux.platform.cluster.pool import EnginePool
from loramux.platform.cluster.protocol import EngineRecord
from loramux.platform.cluster.routing import (
    AffinityRouter,
    LeastLoadedRouter,
    RoundRobinRouter,
    RouterConfig,
)


@dataclass
class Cost:
    step_ms: float = 4.0
    per_token_ms: float = 0.02
    per_adapter_ms: float = 0.3
    load_ms: float = 20.0
    """CPU tier -> GPU slot (stalls the step)."""
    cold_ms: float = 300.0
    """Object store -> engine memory (a fetch beside the loop: only its requests wait)."""


@dataclass
class Req:
    rid: int
    client: int
    adapter: str
    prompt: int
    output: int
    arrival: float
    engine: str = ""
    done: int = 0
    ttft: float = -1.0


@dataclass
class SimEngine:
    """One engine: FCFS waiting queue, admission skips requests whose adapter cannot get a
    slot this step (like a LoRA-aware scheduler), LRU slots, continuous batching."""

    eid: str
    max_num_seqs: int
    max_loras: int
    max_cpu_loras: int
    cost: Cost
    waiting: deque = field(default_factory=deque)
    running: list = field(default_factory=list)
    slots: OrderedDict = field(default_factory=OrderedDict)
    cpu: OrderedDict = field(default_factory=OrderedDict)
    fetching: dict = field(default_factory=dict)
    loads: int = 0
    cold_loads: int = 0
    busy: bool = False

    def view(self) -> EngineRecord:
        return EngineRecord(self.eid, capacity=self.max_num_seqs, max_loras=self.max_loras,
                          running=len(self.running), waiting=len(self.waiting),
                          resident=frozenset(self.slots))

    def _slot_for(self, adapter: str, in_use: set) -> int:
        """0 if resident, 1 if loaded now, -1 if no slot can be freed."""
        if adapter in self.slots:
            self.slots.move_to_end(adapter)
            return 0
        if len(self.slots) >= self.max_loras:
            victim = next((a for a in self.slots if a not in in_use), None)
            if victim is None:
                return -1
            del self.slots[victim]
        self.slots[adapter] = True
        self.loads += 1
        return 1

    def _in_memory(self, adapter: str, now: float) -> bool:
        """In the CPU tier; else start (or keep waiting on) its fetch from the object store."""
        ready = self.fetching.get(adapter)
        if ready is not None and ready <= now:
            del self.fetching[adapter]
            self.cpu[adapter] = True
            while len(self.cpu) > self.max_cpu_loras:
                self.cpu.popitem(last=False)
        if adapter in self.cpu:
            self.cpu.move_to_end(adapter)
            return True
        if ready is None:
            self.fetching[adapter] = now + self.cost.cold_ms
            self.cold_loads += 1
        return False

    def step(self, now: float) -> tuple[float, list[Req]]:
        """Admit, run one step; returns (duration ms, requests that got their first token)."""
        in_use = {r.adapter for r in self.running}
        loaded, prefill, admitted, keep = 0, 0, [], deque()
        while self.waiting and len(self.running) + len(admitted) < self.max_num_seqs:
            r = self.waiting.popleft()
            if not self._in_memory(r.adapter, now):
                keep.append(r)
                continue
            got = self._slot_for(r.adapter, in_use)
            if got < 0:
                keep.append(r)
                continue
            loaded += got
            in_use.add(r.adapter)
            prefill += r.prompt
            admitted.append(r)
        keep.extend(self.waiting)
        self.waiting = keep
        decode = len(self.running)
        self.running.extend(admitted)
        for a in in_use:
            self.slots.move_to_end(a)
        c = self.cost
        if not self.running:  # idle: wait for the first fetch to land
            return min(self.fetching.values(), default=now + c.step_ms) - now, admitted
        ms = (c.step_ms + c.per_token_ms * (prefill + decode) + c.per_adapter_ms * len(in_use)
              + c.load_ms * loaded)
        return ms, admitted


def simulate(policy: str, args, adapters: np.ndarray, lens: np.ndarray) -> dict:
    cost = Cost(load_ms=args.load_ms, cold_ms=args.cold_ms)
    engines = {f"engine-{i}": SimEngine(f"engine-{i}", args.max_num_seqs, args.max_loras,
                                             args.max_cpu_loras, cost)
               for i in range(args.engines)}
    router = {"affinity": AffinityRouter(RouterConfig(queue_threshold=args.queue_threshold)),
              "round_robin": RoundRobinRouter(), "least_loaded": LeastLoadedRouter()}[policy]
    pool = EnginePool(ttl=10.0)
    hb = args.heartbeat_ms
    now, next_hb, sent, finished = 0.0, 0.0, 0, []
    events: list[tuple[float, int, str]] = []  # (time ms, seq, engine id): a step ends
    seq = 0
    warm = int(args.warmup * args.requests)
    mark = (0.0, 0, 0)  # (time ms, slot loads, cold loads) when warm-up ended

    def heartbeat():
        for e in engines.values():
            pool.heartbeat(e.view(), now / 1000)

    def submit(client: int):
        nonlocal sent, seq
        if sent >= args.requests:
            return
        r = Req(sent, client, f"a{adapters[sent]}", int(lens[sent, 0]), int(lens[sent, 1]), now)
        sent += 1
        r.engine = router.route(r.adapter, pool.live(now / 1000), now=now / 1000).engine_id
        pool.started(r.engine)
        e = engines[r.engine]
        e.waiting.append(r)
        if not e.busy:
            e.busy = True
            seq += 1
            heapq.heappush(events, (now, seq, e.eid))

    heartbeat()
    for c in range(args.concurrency):
        submit(c)
    while events:
        t, _, eid = heapq.heappop(events)
        while next_hb <= t:
            now = next_hb
            heartbeat()
            next_hb += hb
        now = t
        e = engines[eid]
        # the step that started at t: finish it at t + ms
        ms, admitted = e.step(t)
        end = t + ms
        for r in admitted:
            r.ttft = end - r.arrival
        done, still = [], []
        for r in e.running:
            r.done += 1
            (done if r.done >= r.output else still).append(r)
        e.running = still
        now = end
        for r in done:
            r.finish = end
            finished.append(r)
            if len(finished) == warm:
                mark = (end, sum(e.loads for e in engines.values()),
                        sum(e.cold_loads for e in engines.values()))
            pool.finished(r.engine)
            submit(r.client)
        if e.running or e.waiting:
            seq += 1
            heapq.heappush(events, (end, seq, eid))
        else:
            e.busy = False
    measured = finished[warm:]
    makespan = (max(r.finish for r in measured) - mark[0]) / 1000
    ttft = np.array([r.ttft for r in measured])
    tokens = sum(r.output for r in measured if r.finish > mark[0])
    loads = sum(e.loads for e in engines.values()) - mark[1]
    cold = sum(e.cold_loads for e in engines.values()) - mark[2]
    per_engine = {eid: sum(1 for r in finished if r.engine == eid) for eid in engines}
    return {"policy": policy, "requests": len(measured),
            "loads_per_1000": 1000 * cold / len(measured),
            "slot_loads_per_1000": 1000 * loads / len(measured),
            "tokens_per_s": tokens / makespan, "makespan_s": makespan,
            "ttft_p50_ms": float(np.percentile(ttft, 50)),
            "ttft_p99_ms": float(np.percentile(ttft, 99)),
            "requests_per_engine": per_engine}


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    fig, axes = plt.subplots(1, 4, figsize=(16, 4))
    panels = (("loads_per_1000", "adapter loads (store -> engine) / 1k req"),
              ("slot_loads_per_1000", "GPU slot loads / 1k req"),
              ("ttft_p99_ms", "p99 TTFT (ms)"), ("tokens_per_s", "output tokens/s"))
    for ax, (key, title) in zip(axes, panels, strict=True):
        ax.bar(names, [results[n][key] for n in names], color=["C0", "C1", "C2"])
        ax.set_title(title)
        ax.tick_params(axis="x", rotation=15)
    fig.suptitle("1,000 adapters, Zipf(1.1), 4 engines, max_loras=8 (simulated fleet, real router)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--adapters", type=int, default=1000)
    ap.add_argument("--zipf", type=float, default=1.1)
    ap.add_argument("--engines", type=int, default=4)
    ap.add_argument("--max-loras", type=int, default=8)
    ap.add_argument("--max-cpu-loras", type=int, default=256)
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--requests", type=int, default=20000)
    ap.add_argument("--concurrency", type=int, default=None)
    ap.add_argument("--queue-threshold", type=int, default=16)
    ap.add_argument("--heartbeat-ms", type=float, default=100.0)
    ap.add_argument("--load-ms", type=float, default=20.0)
    ap.add_argument("--cold-ms", type=float, default=300.0)
    ap.add_argument("--warmup", type=float, default=0.5,
                    help="fraction of requests before measuring (fills the caches)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.concurrency is None:
        args.concurrency = int(1.5 * args.engines * args.max_num_seqs)
    rng = np.random.default_rng(args.seed)
    w = np.arange(1, args.adapters + 1, dtype=float) ** -args.zipf
    adapters = rng.choice(args.adapters, size=args.requests, p=w / w.sum())
    lens = np.stack([rng.integers(64, 512, args.requests), rng.integers(16, 256, args.requests)], 1)
    results = {p: simulate(p, args, adapters, lens)
               for p in ("affinity", "round_robin", "least_loaded")}
    a, rr, ll = results["affinity"], results["round_robin"], results["least_loaded"]
    ratios = {"loads_round_robin_over_affinity": rr["loads_per_1000"] / max(a["loads_per_1000"], 1e-9),
              "slot_loads_round_robin_over_affinity":
                  rr["slot_loads_per_1000"] / max(a["slot_loads_per_1000"], 1e-9),
              "throughput_affinity_over_least_loaded": a["tokens_per_s"] / ll["tokens_per_s"]}
    goal = {"fewer_loads_5x": ratios["loads_round_robin_over_affinity"] >= 5,
            "throughput_within_10pct": ratios["throughput_affinity_over_least_loaded"] >= 0.9}
    for name, r in results.items():
        print(f"{name:13s} loads/1k={r['loads_per_1000']:7.1f} "
              f"slot loads/1k={r['slot_loads_per_1000']:6.1f}  tok/s={r['tokens_per_s']:8.0f}  "
              f"TTFT p50={r['ttft_p50_ms']:7.0f} ms p99={r['ttft_p99_ms']:7.0f} ms  "
              f"per engine={list(r['requests_per_engine'].values())}")
    print(f"round-robin / affinity loads: {ratios['loads_round_robin_over_affinity']:.1f}x; "
          f"affinity / least-loaded tok/s: {ratios['throughput_affinity_over_least_loaded']:.3f}")
    out = write_json("cluster_routing", {"config": vars(args), "results": results,
                                         "ratios": ratios, "goal_met": goal})
    plot(results, RESULTS / "cluster_routing.png")
    print(f"wrote {out} and cluster_routing.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
