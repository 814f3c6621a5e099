"""The model-server protocol metrics on ``--protocol-metrics-port``, scraped from the live
server while mixed traffic runs and parsed with prometheus_client's parser: names, types,
labels and values; the adapter lists follow running and waiting requests; residency
follows loads, evictions and pins; tenancy (names only, once, no key needed)."""

from __future__ import annotations

import time

import httpx
from support.gateway import Stream, Tenants, live_server, names, sample
from support.platform_settings import ADMIN_KEY

GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
          "vllm:gpu_cache_usage_perc",
          "vllm:cache_config_info", "vllm:lora_requests_info", "vllm:lora_adapter_loaded",
          "vllm:num_gpu_loaded_lora_adapters", "vllm:num_cpu_loaded_lora_adapters",
          "vllm:max_gpu_lora_adapters")


def test_series_names_types_and_labels(tenants, engine):
    with live_server(tenants, engine) as live:
        fams = live.scrape()
        for name in GAUGES:
            assert fams[name].type == "gauge", name
        assert not [n for n in fams if n.startswith("vllm:spec_decode")]  # only when configured
        for name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                     "vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"):
            s = sample(fams, name)
            assert s.labels == {"model_name": "tiny", "engine": "0"}
        info = sample(fams, "vllm:cache_config_info")
        assert info.value == 1.0
        assert info.labels["block_size"] == str(engine.config.cache.block_size)
        assert info.labels["num_gpu_blocks"] == "512"
        lora = sample(fams, "vllm:lora_requests_info")
        assert set(lora.labels) == {"max_lora", "running_lora_adapters", "waiting_lora_adapters"}
        assert lora.labels["max_lora"] == "2"  # the slot count
        assert abs(lora.value - time.time()) < 5  # the Unix time of the sample
        assert sample(fams, "vllm:max_gpu_lora_adapters").value == 2
        # no key needed; a HEAD works; other paths are 404
        assert httpx.head(live.metrics_url).status_code == 200
        assert httpx.get(live.metrics_url.replace("/metrics", "/x")).status_code == 404


def test_lists_and_kv_follow_mixed_traffic(tenants, engine):
    """Two slots, three adapters and the base model at once: the adapters in the batch
    are running, the third waits for a slot; both tenants' ``shared`` is one name."""
    url_key = {"alpha": tenants.alpha_key, "beta": tenants.beta_key}
    with live_server(tenants, engine) as live:
        streams = [Stream(live.url, url_key["alpha"], "shared"),
                   Stream(live.url, url_key["beta"], "shared"),
                   Stream(live.url, url_key["alpha"], "a-only"),
                   Stream(live.url, url_key["beta"], "b-only"),
                   Stream(live.url, url_key["alpha"], "tiny")]
        seen_running, seen_waiting, kv_max = set(), set(), 0.0
        deadline = time.monotonic() + 60
        while not all(s.done.is_set() for s in streams):
            assert time.monotonic() < deadline
            fams = live.scrape()
            lora = sample(fams, "vllm:lora_requests_info")
            running, waiting = (names(lora.labels["running_lora_adapters"]),
                                names(lora.labels["waiting_lora_adapters"]))
            assert running | waiting <= {"shared", "a-only", "b-only"}
            assert len(running) <= 2  # never more adapters in the batch than slots
            assert lora.labels["running_lora_adapters"].count("shared") <= 1  # reported once
            seen_running |= running
            seen_waiting |= waiting
            kv = sample(fams, "vllm:kv_cache_usage_perc").value
            assert 0.0 <= kv <= 1.0
            kv_max = max(kv_max, kv)
            assert sample(fams, "vllm:num_requests_running").value <= engine.config.scheduler.max_num_seqs
            text = fams["_text"]
            assert "@" not in text and "/shared" not in text  # never an engine key
            assert f"{tenants.alpha.id}/" not in text and "tenant" not in text
            time.sleep(0.02)
        assert all(s.status == 200 for s in streams)
        assert seen_running == {"shared", "a-only", "b-only"}
        assert seen_waiting, "with 3 adapters on 2 slots one must have waited"
        assert kv_max > 0
        time.sleep(0.15)  # the next scrape after the traffic: all quiet
        fams = live.scrape()
        lora = sample(fams, "vllm:lora_requests_info")
        assert lora.labels["running_lora_adapters"] == lora.labels["waiting_lora_adapters"] == ""
        assert sample(fams, "vllm:num_requests_running").value == 0
        assert sample(fams, "vllm:num_requests_waiting").value == 0
        assert sample(fams, "vllm:kv_cache_usage_perc").value == 0
        # alpha's and beta's "shared" are both resident now: one series names them
        shared = [s for s in fams["vllm:lora_adapter_loaded"].samples
                  if s.labels["adapter_name"] == "shared"]
        assert len(shared) == 1, shared


def test_running_list_follows_one_request(tenants, engine):
    with live_server(tenants, engine) as live:
        s = Stream(live.url, tenants.beta_key, "b-only", max_tokens=200)
        assert s.started.wait(30)
        time.sleep(0.05)
        fams = live.scrape()
        assert not s.done.is_set(), "200 tokens outlast two scrapes"
        lora = sample(fams, "vllm:lora_requests_info")
        assert names(lora.labels["running_lora_adapters"]) == {"b-only"}
        assert sample(fams, "vllm:num_requests_running").value == 1
        assert sample(fams, "vllm:kv_cache_usage_perc").value > 0
        assert s.done.wait(60)


def _admin(live, action: str, key: str) -> None:
    r = httpx.post(f"{live.url}/admin/adapters/{key}/{action}",
                   headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=30)
    assert r.status_code == 200, r.text


def _loaded(live) -> dict[tuple[str, str], str]:
    fams = live.scrape()
    return {(s.labels["adapter_name"], s.labels["level"]): s.labels["pinned"]
            for s in fams["vllm:lora_adapter_loaded"].samples}


def test_residency_follows_loads_evictions_and_pins(tenants, engine):
    with live_server(tenants, engine) as live:
        r = httpx.post(f"{live.url}/v1/completions", headers=Tenants.auth(tenants.alpha_key),
                       json={"model": "a-only", "prompt": "hi", "max_tokens": 2}, timeout=60)
        assert r.status_code == 200
        time.sleep(0.1)
        assert _loaded(live).get(("a-only", "gpu")) == "false"
        key = next(a["key"] for a in _admin_rows(live)
                   if a["adapter"] == "a-only" and a["tenant"] == "alpha")
        _admin(live, "pin", key)
        time.sleep(0.1)
        assert _loaded(live).get(("a-only", "gpu")) == "true"
        _admin(live, "evict", key)  # evict unpins and frees the slot; the CPU tier keeps it
        time.sleep(0.1)
        loaded = _loaded(live)
        assert ("a-only", "gpu") not in loaded and loaded.get(("a-only", "cpu")) == "false"
        fams = live.scrape()
        gpu = sum(1 for s in fams["vllm:lora_adapter_loaded"].samples if s.labels["level"] == "gpu")
        assert sample(fams, "vllm:num_gpu_loaded_lora_adapters").value >= gpu


def _admin_rows(live) -> list:
    r = httpx.get(f"{live.url}/admin/adapters", headers={"Authorization": f"Bearer {ADMIN_KEY}"},
                  timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["data"]
