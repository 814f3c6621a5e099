"""Slots shared fairly: one tenant keeps 12 short requests in flight over 10 adapters of its
own, and the neighbour's 8-token greedy request on its one adapter still finishes within 3×
its idle latency (measured in the same test on the same server) with its idle output, on 2
device slots and on the capacity derived from memory."""

from __future__ import annotations

import statistics
import time

import pytest
from support.adapters import write_random_adapter
from support.attack import Attack
from support.neighbour import idle_after, neighbour_request
from support.server import make_engine

SPRAY_ADAPTERS = 10
SPRAY_CONCURRENCY = 12


@pytest.fixture(scope="module")
def spray_adapters(tenants, tiny_model_dir, tmp_path_factory) -> list[str]:
    root = tmp_path_factory.mktemp("spray")
    names = []
    for i in range(SPRAY_ADAPTERS):
        folder = write_random_adapter(tiny_model_dir, root / f"s{i}", seed=100 + i, std=0.3)
        tenants.registry.upload(tenants.attacker.id, f"spray-{i}", folder)
        names.append(f"spray-{i}")
    return names


@pytest.fixture(scope="module", params=[2, None], ids=["2-slots", "derived-slots"])
def spray_engine(request, tiny_model_dir):
    eng = make_engine(tiny_model_dir, max_model_len=256, max_num_seqs=64, max_waiting=256,
                      max_loras=request.param, max_cpu_loras=16)
    yield eng
    eng.shutdown()


TIMINGS: list[str] = []


def _neighbour(url: str, key: str) -> tuple[float, str]:
    return neighbour_request(url, key, TIMINGS)


def spray(url: str, key: str, adapters: list[str]) -> Attack:
    """``SPRAY_CONCURRENCY`` workers, each sending short requests over the attacker's
    adapters back to back (from their own process) until stopped."""
    bodies = [{"model": adapters[i % len(adapters)], "prompt": f"spray {i}", "max_tokens": 8,
               "temperature": 1.0, "ignore_eos": True} for i in range(SPRAY_CONCURRENCY * len(adapters))]
    return Attack(url, key, bodies, workers=SPRAY_CONCURRENCY, repeat=True)


@pytest.mark.latency
def test_a_tenant_spraying_its_adapters_leaves_the_neighbour_within_3x_idle(
        live, tenants, spray_adapters, spray_engine):
    url, _ = live(engine=spray_engine, model_cache_ttl=5.0)
    _neighbour(url, tenants.neighbour_key)  # warm: loads the adapter
    idle_runs = [_neighbour(url, tenants.neighbour_key) for _ in range(5)]
    expected = idle_runs[0][1]
    attack = spray(url, tenants.attacker_key, spray_adapters).start()
    try:
        deadline = time.monotonic() + 60
        while attack.done < 2 * SPRAY_CONCURRENCY:  # the spray is in full swing
            assert attack.alive(), "the spray's client exited"
            assert time.monotonic() < deadline, "the spray never got going"
            time.sleep(0.05)
        beside = [_neighbour(url, tenants.neighbour_key) for _ in range(5)]
        sprayed, failed = attack.done, attack.failed
    finally:
        attack.stop()
    assert sprayed > 2 * SPRAY_CONCURRENCY
    idle = idle_after(url, tenants.neighbour_key, idle_runs, spray_engine)
    print(f"neighbour beside the spray {[round(t, 3) for t, _ in beside]} s, idle {idle:.3f} s, "
          f"{sprayed} spray requests ({failed} failed); timing {TIMINGS[-5:]}")
    assert all(text == expected for _, text in beside)  # the neighbour's output is untouched
    latency = statistics.median(t for t, _ in beside)
    assert latency <= 3 * idle, f"beside the spray {beside}, idle {idle:.3f} s"
