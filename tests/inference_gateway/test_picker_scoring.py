"""A small endpoint picker, written from the protocol's documented scorer rules (the
Gateway API Inference Extension / llm-d router: lora-affinity, queue depth, KV-cache
utilisation, and the proposed residency "load-state" scorer), picks between two real
engines from their scraped protocol metrics and must pick the one holding the adapter.

Rules (llm-d-router ``scorer/*/README.md``):
* lora-affinity: 1.0 when the adapter is in ``running_lora_adapters``; 0.8 when the
  server has room for one more (running + waiting < ``max_lora``); 0.6 when it is in
  ``waiting_lora_adapters``; else 0;
* queue: ``(max_queue - queue) / (max_queue - min_queue)`` over the candidates, 1.0 when
  all are equal;
* kv-cache-utilization: ``1 - kv_cache_usage_perc``;
* load-state (llm-d-router#2792, from ``vllm:lora_adapter_loaded``): 1.0 resident on the
  GPU, 0.7 in CPU memory, 0.6 a free GPU slot, 0.3 slots full, 0 otherwise.
The picker takes the highest weighted sum.
"""

from __future__ import annotations

import contextlib
import time

import httpx
from support.gateway import Stream, Tenants, live_server, names, sample
from support.server import make_engine


def affinity(f: dict, model: str) -> float:
    lora = sample(f, "vllm:lora_requests_info").labels
    running, waiting = names(lora["running_lora_adapters"]), names(lora["waiting_lora_adapters"])
    if model in running:
        return 1.0
    if len(running) + len(waiting) < int(lora["max_lora"]):
        return 0.8
    return 0.6 if model in waiting else 0.0


def load_state(f: dict, model: str) -> float:
    levels = {s.labels["level"] for s in f["vllm:lora_adapter_loaded"].samples
              if s.labels["adapter_name"] == model}
    if "gpu" in levels:
        return 1.0
    if "cpu" in levels:
        return 0.7
    free = sample(f, "vllm:max_gpu_lora_adapters").value - sample(
        f, "vllm:num_gpu_loaded_lora_adapters").value
    return 0.6 if free > 0 else 0.3


def pick(scrapes: dict[str, dict], model: str, weights: dict[str, float]) -> str:
    queues = {e: sample(f, "vllm:num_requests_waiting").value for e, f in scrapes.items()}
    lo, hi = min(queues.values()), max(queues.values())
    scores = {}
    for e, f in scrapes.items():
        queue = 1.0 if hi == lo else (hi - queues[e]) / (hi - lo)
        kv = 1.0 - sample(f, "vllm:kv_cache_usage_perc").value
        scores[e] = (weights["lora"] * affinity(f, model) + weights["queue"] * queue
                     + weights["kv"] * kv + weights["load"] * load_state(f, model))
    return max(scores, key=scores.get)


def test_the_picker_routes_to_the_engine_holding_the_adapter(tenants, tiny_model_dir):
    engines = [make_engine(tiny_model_dir, max_model_len=512, max_num_seqs=8, max_loras=2,
                           max_cpu_loras=4, num_gpu_blocks=1024) for _ in range(2)]
    try:
        with contextlib.ExitStack() as stack:
            e1, e2 = (stack.enter_context(live_server(tenants, e)) for e in engines)
            h = Tenants.auth(tenants.alpha_key)
            for live, model in ((e1, "shared"), (e2, "a-only")):
                r = httpx.post(f"{live.url}/v1/completions", headers=h, timeout=60,
                               json={"model": model, "prompt": "warm me", "max_tokens": 2})
                assert r.status_code == 200
            time.sleep(0.1)
            scrapes = {"e1": e1.scrape(), "e2": e2.scrape()}
            # idle, resident adapters: the documented lora-affinity rule alone cannot tell
            # (nothing is running: 0.8 on both); the residency series can
            classic = {"lora": 1, "queue": 1, "kv": 1, "load": 0}
            with_residency = {"lora": 1, "queue": 1, "kv": 1, "load": 1}
            assert affinity(scrapes["e1"], "shared") == affinity(scrapes["e2"], "shared") == 0.8
            assert pick(scrapes, "shared", with_residency) == "e1"
            assert pick(scrapes, "a-only", with_residency) == "e2"
            # an adapter with a request in flight on e2: the classic rules pick e2 too
            stream = Stream(e2.url, tenants.alpha_key, "a-only", max_tokens=200)
            assert stream.started.wait(30)
            time.sleep(0.05)
            scrapes = {"e1": e1.scrape(), "e2": e2.scrape()}
            assert not stream.done.is_set(), "200 tokens outlast two scrapes"
            assert affinity(scrapes["e2"], "a-only") == 1.0
            assert pick(scrapes, "a-only", classic) == "e2"
            assert pick(scrapes, "a-only", with_residency) == "e2"
            assert pick(scrapes, "shared", with_residency) == "e1"
            assert stream.done.wait(60) and stream.status == 200
    finally:
        for e in engines:
            e.shutdown()
