"""Hostile engine load over HTTP: an ``n`` flood, a failing step and a dead engine loop,
each beside the neighbour's canary; the server stays ready (or comes back) afterwards."""

from __future__ import annotations

import threading

import httpx
import pytest


def _attack(url, tenants, body, timeout=60):
    return httpx.post(f"{url}/v1/completions", headers=tenants.auth(tenants.attacker_key),
                      timeout=timeout, json={"model": "attacker-lora", **body})


@pytest.mark.latency
def test_n_flood_leaves_the_neighbour_within_bound(live, tenants):
    url, canary = live()
    body = {"prompt": "flood", "n": 32, "max_tokens": 24, "temperature": 1.0, "ignore_eos": True}
    codes: list[int] = []
    threads = [threading.Thread(target=lambda: codes.append(_attack(url, tenants, body).status_code))
               for _ in range(3)]
    with canary.beside():
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    assert codes and all(c in (200, 429) for c in codes), codes


@pytest.mark.latency
def test_a_failing_step_fails_its_request_and_the_neighbour_goes_on(live, tenants, engine,
                                                                      monkeypatch):
    url, canary = live()
    original = engine.engine.runner.run_batch
    calls: list[int] = []

    def run_once_broken(batch, copies=()):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("can't allocate memory")
        return original(batch, copies)

    monkeypatch.setattr(engine.engine.runner, "run_batch", run_once_broken)
    r = _attack(url, tenants, {"prompt": "boom", "max_tokens": 4})
    assert r.status_code == 500, r.text
    assert r.json()["error"]["code"] == "engine_step_failed", r.text
    assert "allocate" not in r.text
    canary.check()
    assert httpx.get(f"{url}/ready", timeout=10).status_code == 200
    assert _attack(url, tenants, {"prompt": "again", "max_tokens": 4}).status_code == 200


@pytest.mark.latency
def test_a_dead_loop_gives_503_and_the_engine_serves_again(live, tenants, engine, monkeypatch):
    url, canary = live()
    original = engine.engine.scheduler.schedule
    calls: list[int] = []

    def schedule_once_broken():
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("scheduler bug")
        return original()

    monkeypatch.setattr(engine.engine.scheduler, "schedule", schedule_once_broken)
    r = _attack(url, tenants, {"prompt": "die", "max_tokens": 4}, timeout=10)
    assert r.status_code == 503, r.text
    assert r.json()["error"]["code"] == "engine_dead", r.text
    for _ in range(100):
        if httpx.get(f"{url}/ready", timeout=10).status_code == 200:
            break
        threading.Event().wait(0.05)
    assert httpx.get(f"{url}/ready", timeout=10).status_code == 200
    canary.check()
    assert _attack(url, tenants, {"prompt": "alive", "max_tokens": 4}).status_code == 200


@pytest.mark.latency
def test_one_long_prompt_among_short_ones_finishes(live, tenants, engine):
    url, canary = live()
    long_ids = [7] * (engine.engine.max_model_len - 8)
    # 48 prompts: more than run at once (max_num_seqs 32), fewer than the waiting queue holds
    # (max_waiting 64) beside a waiting canary. A request of all 64 was refused (429) by design
    # whenever a canary request was waiting as its prompts arrived: past max_waiting a key gets
    # its share of the queue, half with two keys waiting.
    prompts = [long_ids] + [[5, 6, 7]] * 47
    with canary.beside():
        r = _attack(url, tenants, {"prompt": prompts, "max_tokens": 4})
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 48
