"""vLLM's speculative-decoding counters on the protocol metrics listener of a live server
with ``--speculative-config``, parsed with prometheus_client's parser: vLLM v1's names,
types and labels, every position from the start, monotonic while copy-heavy requests of
two tenants' adapters and the base model run, and equal afterwards to the sums of the
server's own per-adapter ``loramux_spec_decode_*`` series."""

from __future__ import annotations

import concurrent.futures
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from support.gateway import Tenants, live_server, sample
from support.platform_settings import ADMIN_KEY
from support.server import make_engine

K = 4
SPEC = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
PROMPT = "SELECT name FROM users WHERE id = 1; SELECT name FROM users WHERE id = 2; SELECT"
COUNTERS = {"vllm:spec_decode_num_drafts": "loramux_spec_decode_num_drafts",
            "vllm:spec_decode_num_draft_tokens": "loramux_spec_decode_num_draft_tokens",
            "vllm:spec_decode_num_accepted_tokens": "loramux_spec_decode_num_accepted_tokens"}
PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"
LABELS = {"model_name": "tiny", "engine": "0"}


@pytest.fixture(scope="module")
def spec_engine(tiny_model_dir):
    # no step budget: under an ITL target drafts share the prompt cap with waiting prompts, so
    # on a slow machine the rows that run while two adapters wait for the 2 slots would not
    # draft at all, and which adapters have series would depend on the machine's speed
    eng = make_engine(tiny_model_dir, max_model_len=256, max_num_seqs=16, max_loras=2,
                      max_cpu_loras=6, num_gpu_blocks=512, speculative_config=SPEC,
                      enable_step_budget=False)
    yield eng
    eng.shutdown()


def protocol_values(fams: dict) -> dict:
    """The protocol series' values: counter name -> value, and positions -> values."""
    out = {}
    for name in COUNTERS:
        assert fams[name].type == "counter", name
        (s,) = fams[name].samples
        assert s.name == f"{name}_total" and s.labels == LABELS, s
        out[name] = s.value
    per_pos = fams[PER_POS]
    assert per_pos.type == "counter"
    assert all(s.name == f"{PER_POS}_total" and {k: s.labels[k] for k in LABELS} == LABELS
               for s in per_pos.samples)
    out[PER_POS] = {int(s.labels["position"]): s.value for s in per_pos.samples}
    return out


def server_sums(live) -> dict:
    """The server's own per-adapter series (``/metrics``, admin key), summed over adapters."""
    r = httpx.get(f"{live.url}/metrics", headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=30)
    assert r.status_code == 200, r.text
    fams = {f.name: f for f in text_string_to_metric_families(r.text)}
    out: dict = {vllm: sum(s.value for s in fams[ours].samples) for vllm, ours in COUNTERS.items()}
    per_pos: dict[int, float] = {}
    for s in fams["loramux_spec_decode_num_accepted_tokens_per_pos"].samples:
        pos = int(s.labels["position"])
        per_pos[pos] = per_pos.get(pos, 0.0) + s.value
    out[PER_POS] = per_pos
    out["adapters"] = {s.labels["adapter"] for s in fams["loramux_spec_decode_num_drafts"].samples}
    return out


def complete(url: str, key: str, model: str) -> None:
    r = httpx.post(f"{url}/v1/completions", headers=Tenants.auth(key), timeout=120,
                   json={"model": model, "prompt": PROMPT, "max_tokens": 32, "temperature": 0,
                         "ignore_eos": True})
    assert r.status_code == 200, r.text


def test_spec_decode_counters_match_the_per_adapter_series(tenants, spec_engine):
    with live_server(tenants, spec_engine) as live:
        before = protocol_values(live.scrape())  # present before any request, every position
        assert set(before[PER_POS]) == set(range(K))
        jobs = [(tenants.alpha_key, "shared"), (tenants.beta_key, "shared"),
                (tenants.alpha_key, "a-only"), (tenants.beta_key, "b-only"),
                (tenants.alpha_key, "tiny")]
        with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
            futures = [pool.submit(complete, live.url, key, model) for key, model in jobs]
            last = before
            while not all(f.done() for f in futures):
                now = protocol_values(live.scrape())
                for name in COUNTERS:  # counters: never down
                    assert now[name] >= last[name], (name, last, now)
                last = now
                time.sleep(0.02)
            for f in futures:
                f.result()
        deadline = time.monotonic() + 10
        while True:  # the listener serves the report of the last step: wait for it
            ours, theirs = server_sums(live), protocol_values(live.scrape())
            if all(theirs[n] == ours[n] for n in COUNTERS) or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert len(ours["adapters"]) >= 4, ours["adapters"]  # 4 adapters' counts and the base's
        for name in COUNTERS:
            assert theirs[name] == ours[name], (name, theirs, ours)
        assert theirs["vllm:spec_decode_num_accepted_tokens"] > 0
        assert theirs["vllm:spec_decode_num_drafts"] > before["vllm:spec_decode_num_drafts"]
        assert theirs[PER_POS] == {p: ours[PER_POS].get(p, 0.0) for p in range(K)}
        assert sum(theirs[PER_POS].values()) == theirs["vllm:spec_decode_num_accepted_tokens"]
        assert theirs[PER_POS][0] <= theirs["vllm:spec_decode_num_drafts"]
        assert all(theirs[PER_POS][p] >= theirs[PER_POS][p + 1] for p in range(K - 1))
        print(f"protocol {theirs}, per-adapter sums {ours}")
        assert sample(live.scrape(), "vllm:num_requests_running").value == 0
