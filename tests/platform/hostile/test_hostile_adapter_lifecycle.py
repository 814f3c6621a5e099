"""Deleting an adapter while a request for it waits in the engine's queue fails that
request at once (within 1 s) with a clear error; the running request of another adapter
finishes, other adapters keep flowing, and the neighbour's canary keeps its latency."""

from __future__ import annotations

import concurrent.futures
import time

import httpx
import pytest
from support.platform_settings import BASE
from support.server import make_engine


@pytest.fixture
def one_slot_engine(tiny_model_dir):
    """One adapter slot: a running request of one adapter makes any other adapter wait."""
    eng = make_engine(tiny_model_dir, max_model_len=512, max_num_seqs=16, max_loras=1,
                      max_cpu_loras=4)
    yield eng
    eng.shutdown()


def _waiting_for(engine, name: str) -> bool:
    """Whether a request for adapter ``name`` sits in the engine's queue (asked on the
    engine thread)."""
    def ask() -> bool:
        return any(seq.lora_key is not None and f"/{name}@" in seq.lora_key
                   for seq in engine.engine.scheduler.waiting)
    return engine.call_sync(ask, timeout=10)


def _post(url, key, model, **extra):
    start = time.monotonic()
    r = httpx.post(f"{url}/v1/completions", headers={"Authorization": f"Bearer {key}"},
                   json={"model": model, "prompt": "hello", "max_tokens": 4, "temperature": 0,
                         **extra}, timeout=60)
    return r, time.monotonic() - start, time.monotonic()


@pytest.mark.latency
def test_delete_while_queued_fails_the_queued_request_at_once(live, tenants, one_slot_engine):
    reg = tenants.registry
    reg.upload(tenants.attacker.id, "doomed-lora", tenants.adapter_dirs[2])
    reg.upload(tenants.neighbour.id, "blocker-lora", tenants.adapter_dirs[0])
    url, canary = live(engine=one_slot_engine, canary_model=BASE)
    nkey, akey = tenants.neighbour_key, tenants.attacker_key
    with concurrent.futures.ThreadPoolExecutor(2) as pool, canary.beside():
        blocker = pool.submit(_post, url, nkey, "blocker-lora", max_tokens=300, ignore_eos=True)
        deadline = time.monotonic() + 20
        while one_slot_engine.stats().num_running == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        queued = pool.submit(_post, url, akey, "doomed-lora")
        while not _waiting_for(one_slot_engine, "doomed-lora") and time.monotonic() < deadline:
            time.sleep(0.01)
        assert _waiting_for(one_slot_engine, "doomed-lora") and not blocker.done()
        r = httpx.delete(f"{url}/v1/adapters/doomed-lora",
                         headers={"Authorization": f"Bearer {akey}"}, timeout=30)
        deleted_at = time.monotonic()
        assert r.status_code == 200, r.text
        failed, _, failed_at = queued.result(timeout=10)
        assert failed.status_code == 409, failed.text
        err = failed.json()["error"]
        assert err["code"] == "adapter_gone" and "doomed-lora" in err["message"]
        assert failed_at - deleted_at < 1.0
        done, _, _ = blocker.result(timeout=60)
    assert done.status_code == 200 and done.json()["usage"]["completion_tokens"] == 300
    r, _, _ = _post(url, nkey, "neighbour-lora")
    assert r.status_code == 200, r.text
    assert one_slot_engine.stats().num_waiting == 0


def test_replacing_only_the_config_takes_effect(live, tenants, tmp_path):
    import json
    import shutil

    reg = tenants.registry
    src = tmp_path / "v1"
    shutil.copytree(tenants.adapter_dirs[1], src)
    reg.upload(tenants.attacker.id, "swap-lora", src)
    url, _ = live()
    body = {"prompt": "hello", "max_tokens": 4, "temperature": 0, "logprobs": 1}
    first, _, _ = _post(url, tenants.attacker_key, "swap-lora", **body)
    v2 = tmp_path / "v2"
    shutil.copytree(src, v2)
    config = json.loads((v2 / "adapter_config.json").read_text())
    config["lora_alpha"] = config["lora_alpha"] * 8
    (v2 / "adapter_config.json").write_text(json.dumps(config))
    reg.upload(tenants.attacker.id, "swap-lora", v2, replace=True)
    second, _, _ = _post(url, tenants.attacker_key, "swap-lora", **body)
    assert first.status_code == second.status_code == 200
    lp1 = first.json()["choices"][0]["logprobs"]["token_logprobs"]
    lp2 = second.json()["choices"][0]["logprobs"]["token_logprobs"]
    assert lp1 != lp2  # alpha × 8 changes the adapter's scale, so the logits
    reg.delete(tenants.attacker.id, "swap-lora")
