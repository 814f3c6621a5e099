"""The step-time budget over HTTP: one tenant keeps 256 sequences running (8 streams of
``n: 32``), and the neighbour's 8-token greedy request still finishes within 3× its idle
latency, measured in the same test on the same server."""

from __future__ import annotations

import statistics
import time

import httpx
import pytest
from support.attack import Attack
from support.server import make_engine

FLOOD_STREAMS = 8
FLOOD_N = 32


@pytest.fixture(scope="module")
def flood_engine(tiny_model_dir):
    eng = make_engine(tiny_model_dir, max_model_len=512, max_num_seqs=FLOOD_STREAMS * FLOOD_N + 8,
                      max_waiting=64, max_loras=2, max_cpu_loras=4)
    yield eng
    eng.shutdown()


def _quiet(url: str, key: str) -> float:
    start = time.monotonic()
    r = httpx.post(f"{url}/v1/completions", headers={"Authorization": f"Bearer {key}"}, timeout=120,
                   json={"model": "neighbour-lora", "prompt": "hello there", "max_tokens": 8,
                         "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 8
    return time.monotonic() - start


def flood(url: str, key: str) -> Attack:
    """``FLOOD_STREAMS`` non-streaming ``n: 32`` requests of the attacker, from their own
    process; stopping it drops them, and the server aborts them on the disconnect."""
    body = {"model": "attacker-lora", "prompt": "flood", "n": FLOOD_N, "max_tokens": 400,
            "temperature": 1.0, "ignore_eos": True}
    return Attack(url, key, [body], workers=FLOOD_STREAMS, repeat=False)


@pytest.mark.latency
def test_flood_of_256_sequences_leaves_the_neighbour_within_3x_idle(live, tenants, flood_engine):
    url, _ = live(engine=flood_engine)
    _quiet(url, tenants.neighbour_key)  # warm: loads the adapter
    idle = statistics.median(_quiet(url, tenants.neighbour_key) for _ in range(5))  # as beside
    attack = flood(url, tenants.attacker_key).start()
    try:
        deadline = time.monotonic() + 60
        while flood_engine.stats().num_running < FLOOD_STREAMS * FLOOD_N:
            assert time.monotonic() < deadline, f"flood never reached {FLOOD_STREAMS * FLOOD_N} sequences"
            assert attack.alive(), "the flood's client exited"
            time.sleep(0.05)
        beside = [_quiet(url, tenants.neighbour_key) for _ in range(5)]  # median of 5: one slow outlier is noise
        running = flood_engine.stats().num_running
    finally:
        attack.stop()
    assert running >= FLOOD_STREAMS * FLOOD_N - 8, running  # the flood was still on
    print(f"quiet beside the flood {beside} s, idle {idle:.3f} s")
    assert statistics.median(beside) <= 3 * idle, f"beside the flood {beside}, idle {idle:.3f} s"
