"""Cluster state over a real Redis: registration with heartbeat TTL, pub/sub fan-out,
and behaviour while Redis is down (engines serve on, gateways route on the last view)."""

from __future__ import annotations

import threading
import time

import pytest
import redis

from loramux.platform.cluster.heartbeat import EngineHeartbeat
from loramux.platform.cluster.protocol import ClusterEvent, EngineRecord
from loramux.platform.cluster.redis_state import ClusterState
from loramux.platform.cluster.routing import AffinityRouter
from loramux.platform.cluster.view import GatewayView


def record(eid: str, **kw) -> EngineRecord:
    return EngineRecord(eid, url=f"http://{eid}", capacity=8, max_loras=4, **kw)


def wait_for(pred, timeout=5.0, step=0.02):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(step)
    return pred()


def test_records_round_trip_and_expire(redis_client, namespace):
    st = ClusterState(redis_client, namespace, ttl=0.4)
    rec = record("e0", running=2, waiting=1, resident=("a", "b"), prefixes=("p1",), kv_usage=0.5)
    st.publish_engine(rec)
    st.publish_engine(record("e1"))
    got = {r.engine_id: r for r in st.read_engines()}
    assert got["e0"] == rec and set(got) == {"e0", "e1"}
    assert got["e0"].resident == frozenset({"a", "b"}) and got["e0"].load == 3
    time.sleep(0.25)
    st.publish_engine(record("e1"))  # e1 beats, e0 does not
    time.sleep(0.25)
    assert [r.engine_id for r in st.read_engines()] == ["e1"]
    assert redis_client.smembers(f"{namespace}:engines") == {b"e1"}  # pruned
    st.remove_engine("e1")
    assert st.read_engines() == []


def test_namespaces_do_not_mix(redis_client, namespace):
    ClusterState(redis_client, namespace).publish_engine(record("e0"))
    assert ClusterState(redis_client, namespace + "-other").read_engines() == []


def test_gateway_view_tracks_registrations_and_heartbeat_ttl(redis_client, namespace):
    st = ClusterState(redis_client, namespace, ttl=0.5)
    view = GatewayView(st)
    beats = [EngineHeartbeat(st, lambda e=e: record(e, resident=("a",)), interval=0.1)
             for e in ("e0", "e1")]
    for b in beats:
        b.start()
    view.refresh()
    assert [v.engine_id for v in view.live()] == ["e0", "e1"]
    beats[0].stop()  # e0 dies without deregistering
    assert wait_for(lambda: view.refresh() and [v.engine_id for v in view.live()] == ["e1"],
                    timeout=2.0)
    beats[1].stop(engine_id="e1")  # graceful: gone at once
    view.refresh()
    assert view.live() == []


def test_failed_engine_stays_out_until_ttl(redis_client, namespace):
    st = ClusterState(redis_client, namespace, ttl=0.3)
    st.publish_engine(record("e0"))
    st.publish_engine(record("e1"))
    view = GatewayView(st)
    view.refresh()
    view.mark_failed("e0")
    st.publish_engine(record("e0"))
    view.refresh()
    assert [v.engine_id for v in view.live()] == ["e1"]
    time.sleep(0.35)
    st.publish_engine(record("e0"))
    st.publish_engine(record("e1"))
    view.refresh()
    assert [v.engine_id for v in view.live()] == ["e0", "e1"]


def test_events_fan_out_to_every_subscriber(redis_client, namespace):
    st = ClusterState(redis_client, namespace)
    got: dict[str, list[ClusterEvent]] = {"gw": [], "e0": [], "e1": []}
    subs = [st.subscribe(got[name].append, name=name) for name in got]
    assert all(s.ready.wait(5) for s in subs)
    events = [ClusterEvent("evict", adapter_id="t1/sql", origin="gw"),
              ClusterEvent("adapter_deleted", adapter_id="t1/old", tenant_id="t1"),
              ClusterEvent("key_revoked", key_id="k9", tenant_id="t1")]
    for ev in events:
        assert st.publish_event(ev) == 3
    assert wait_for(lambda: all(len(v) == 3 for v in got.values()))
    assert all(v == events for v in got.values())
    for s in subs:
        s.close()
    with pytest.raises(ValueError, match="unknown cluster event kind"):
        ClusterEvent("explode")


def test_a_failing_handler_does_not_stop_delivery(redis_client, namespace):
    st = ClusterState(redis_client, namespace)
    seen = []

    def handler(ev):
        seen.append(ev)
        if len(seen) == 1:
            raise RuntimeError("boom")

    sub = st.subscribe(handler)
    assert sub.ready.wait(5)
    st.publish_event(ClusterEvent("warm", adapter_id="a"))
    st.publish_event(ClusterEvent("pin", adapter_id="a"))
    assert wait_for(lambda: len(seen) == 2)
    sub.close()


def test_redis_down_gateway_routes_on_last_view_and_recovers(private_redis):
    client = redis.Redis.from_url(private_redis.url, socket_timeout=0.5,
                                  socket_connect_timeout=0.5)
    st = ClusterState(client, "lmx", ttl=0.5)
    hb = EngineHeartbeat(st, lambda: record("e0", resident=("a",)), interval=0.1)
    hb.start()
    st.publish_engine(record("e1"))
    view = GatewayView(st)
    assert view.refresh() and not view.degraded
    received = []
    resyncs = []
    sub = st.subscribe(received.append, on_resubscribe=lambda: resyncs.append(time.monotonic()))
    assert sub.ready.wait(5)
    assert resyncs == []  # the first subscription is no resubscription

    private_redis.kill()
    assert not view.refresh()
    assert view.degraded and view.last_error
    time.sleep(0.7)  # past the TTL: the last view is kept anyway, nothing expires
    live = view.live()
    assert [v.engine_id for v in live] == ["e0", "e1"]
    assert AffinityRouter().route("a", live).engine_id == "e0"
    assert wait_for(lambda: not hb.ok, timeout=2.0)  # the engine notices, serves on

    private_redis.start()  # same port, empty: state is rebuilt from heartbeats
    assert wait_for(lambda: hb.ok, timeout=3.0)
    assert wait_for(lambda: view.refresh() and not view.degraded, timeout=3.0)
    assert [v.engine_id for v in view.live()] == ["e0"]  # e1 never beat again
    assert wait_for(lambda: sub.ready.is_set(), timeout=5.0)  # subscriber reconnected
    assert wait_for(lambda: len(resyncs) == 1, timeout=3.0)  # told to forget what it missed
    assert wait_for(lambda: st.publish_event(ClusterEvent("evict", adapter_id="a")) == 1, 3.0)
    assert wait_for(lambda: len(received) == 1, timeout=3.0)
    hb.stop()
    sub.close()


def test_heartbeat_thread_keeps_state_current(redis_client, namespace):
    st = ClusterState(redis_client, namespace, ttl=1.0)
    resident: list[str] = []
    lock = threading.Lock()

    def snap():
        with lock:
            return record("e0", resident=tuple(resident))

    hb = EngineHeartbeat(st, snap, interval=0.05)
    hb.start()
    with lock:
        resident.append("new")
    assert wait_for(lambda: st.read_engines()[0].resident == {"new"}, timeout=2.0)
    hb.stop(engine_id="e0")
    assert st.read_engines() == []
