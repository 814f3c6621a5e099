"""Routing policy (pure): affinity, rendezvous placement, bounded-load spill-over,
replication of hot adapters, prefix preference, retries excluding failed engines."""

from __future__ import annotations

import collections

import pytest

from loramux.platform.cluster.pool import EnginePool
from loramux.platform.cluster.protocol import EngineRecord
from loramux.platform.cluster.routing import (
    AffinityRouter,
    LeastLoadedRouter,
    NoEngineAvailable,
    RoundRobinRouter,
    RouterConfig,
    prefix_hashes,
    rendezvous_order,
)

IDS = ["e0", "e1", "e2", "e3"]


def fleet(**per_engine) -> list[EngineRecord]:
    """Four idle engines (capacity 4); per_engine['e1'] = dict of overrides."""
    return [EngineRecord(eid, capacity=4, max_loras=8, **per_engine.get(eid, {})) for eid in IDS]


def test_rendezvous_is_stable_and_spreads_adapters():
    homes = collections.Counter(rendezvous_order(f"a{i}", IDS)[0] for i in range(4000))
    assert set(homes) == set(IDS)
    assert all(800 < n < 1200 for n in homes.values()), homes
    # removing one engine moves only the adapters that lived there
    moved = sum(rendezvous_order(f"a{i}", IDS)[0] != rendezvous_order(f"a{i}", IDS[:3])[0]
                for i in range(4000))
    assert moved == homes["e3"]


def test_cold_adapter_goes_home_then_sticks():
    r = AffinityRouter()
    home = rendezvous_order("sql", IDS)[0]
    d = r.route("sql", fleet(), now=0.0)
    assert (d.engine_id, d.reason) == (home, "placement")
    # before any heartbeat reports it resident, the placement is remembered
    assert r.route("sql", fleet(), now=1.0) == type(d)(home, "affinity")


def test_resident_engine_wins_over_rendezvous_home():
    home = rendezvous_order("sql", IDS)[0]
    other = next(e for e in IDS if e != home)
    d = AffinityRouter().route("sql", fleet(**{other: {"resident": frozenset({"sql"})}}))
    assert (d.engine_id, d.reason) == (other, "affinity")


def test_longest_cached_prefix_breaks_ties_between_holders():
    text = "x" * 1024
    p = prefix_hashes("sql", text)
    assert len(p) == 4
    res = frozenset({"sql"})
    engines = fleet(e1={"resident": res, "prefixes": frozenset(p[:1])},
                    e2={"resident": res, "prefixes": frozenset(p[:3])},
                    e3={"resident": res, "prefixes": frozenset(p[1:])})  # no first chunk: 0
    assert AffinityRouter().route("sql", engines, prefixes=p).engine_id == "e2"
    # hashes depend on the adapter: the same text under another adapter shares nothing
    assert not set(prefix_hashes("other", text)) & set(p)


def test_spill_over_replicates_a_hot_adapter_then_shares_by_load():
    r = AffinityRouter(RouterConfig(queue_threshold=2))
    order = rendezvous_order("hot", IDS)
    res = frozenset({"hot"})
    full = {"resident": res, "running": 4, "waiting": 2}  # capacity 4, queue at threshold
    d = r.route("hot", fleet(**{order[0]: full}), now=0.0)
    assert (d.engine_id, d.reason) == (order[1], "spill")
    # now both hold it: the next request goes to whichever has room, by load
    engines = fleet(**{order[0]: {"resident": res, "running": 3},
                       order[1]: {"resident": res, "running": 1}})
    assert r.route("hot", engines, now=1.0) == type(d)(order[1], "affinity")


def test_below_threshold_stays_on_the_holder_even_if_others_are_idle():
    r = AffinityRouter(RouterConfig(queue_threshold=2))
    order = rendezvous_order("a", IDS)
    busy = {"resident": frozenset({"a"}), "running": 4, "waiting": 1}
    assert r.route("a", fleet(**{order[0]: busy})).engine_id == order[0]


def test_saturated_fleet_keeps_adapters_home_within_the_load_factor():
    """Every queue past the threshold: a holder within load_factor x mean keeps the
    adapter; one beyond it spills to the least-loaded side of the rendezvous order."""
    r = AffinityRouter(RouterConfig(queue_threshold=0, load_factor=1.25))
    res = frozenset({"a"})
    engines = fleet(e0={"running": 5}, e1={"running": 9, "resident": res},
                    e2={"running": 6, "resident": res}, e3={"running": 5})  # mean 6.25
    assert (r.route("a", engines).engine_id, r.route("a", engines).reason) == ("e2", "affinity")
    engines = fleet(e0={"running": 5}, e1={"running": 12, "resident": res},
                    e2={"running": 5}, e3={"running": 5})  # e1 > 1.25 x (7.75 + 1) - 1
    d = r.route("a", engines)
    assert d.reason == "spill" and d.engine_id != "e1"


def test_retry_excludes_failed_engines_and_runs_out():
    r = AffinityRouter()
    first = r.route("a", fleet()).engine_id
    second = r.route("a", fleet(), exclude=[first]).engine_id
    assert second != first
    with pytest.raises(NoEngineAvailable):
        r.route("a", fleet(), exclude=IDS)


def test_base_model_requests_prefer_prefix_then_load():
    p = prefix_hashes(None, "y" * 600)
    engines = fleet(e0={"running": 3}, e1={"running": 1}, e2={"running": 2})
    assert AffinityRouter().route(None, engines).engine_id == "e3"
    engines = fleet(e0={"running": 2, "prefixes": frozenset(p)}, e3={"running": 1})
    assert AffinityRouter().route(None, engines, prefixes=p).engine_id == "e0"


def test_baselines():
    rr = RoundRobinRouter()
    assert [rr.route("a", fleet()).engine_id for _ in range(5)] == IDS + ["e0"]
    engines = fleet(e0={"running": 2}, e1={"running": 1}, e2={"running": 1}, e3={"running": 3})
    assert LeastLoadedRouter().route("a", engines).engine_id == "e1"


def test_config_validation():
    with pytest.raises(ValueError, match="queue_threshold"):
        RouterConfig(queue_threshold=-1)
    with pytest.raises(ValueError, match="load_factor"):
        RouterConfig(load_factor=0.5)


def test_pool_expires_missed_heartbeats_and_counts_inflight():
    pool = EnginePool(ttl=3.0)
    pool.heartbeat(EngineRecord("e0", capacity=4), seen_at=0.0)
    pool.heartbeat(EngineRecord("e1", capacity=4, running=1), seen_at=1.0)
    pool.heartbeat(EngineRecord("e1", capacity=4, running=7), seen_at=0.5)  # stale: ignored
    assert [v.load for v in pool.live(2.0)] == [0, 1]
    for _ in range(3):
        pool.started("e1")
    assert pool.live(2.0)[1].load == 3  # 3 in flight > 1 reported
    pool.finished("e1")
    assert pool.live(2.0)[1].load == 2
    assert [v.engine_id for v in pool.live(3.5)] == ["e1"]  # e0 last seen at 0
    assert pool.expire(4.5) == ["e1"] and pool.live(4.5) == []


def test_pool_residency_notes():
    pool = EnginePool()
    pool.heartbeat(EngineRecord("e0", resident=frozenset({"a"})), 0.0)
    pool.heartbeat(EngineRecord("e1"), 0.0)
    pool.note_resident("e1", "a")
    assert all("a" in v.resident for v in pool.live(0.0))
    pool.note_evicted("a")
    assert not any("a" in v.resident for v in pool.live(0.0))
