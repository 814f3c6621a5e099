"""Bulkheads: a stalled dependency costs a caller its deadline, never more; a full pool
and an open breaker answer at once; another dependency's bulkhead is untouched; the
breaker closes again once the dependency answers."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from sqlalchemy.exc import OperationalError

from loramux.platform.bulkheads import (
    Bulkhead,
    Dependencies,
    DependencyPolicy,
    DependencyUnavailable,
    dependency_kind,
)


def _bulkhead(**kw) -> Bulkhead:
    args = dict(workers=2, timeout=0.3, retry_after=3, failures=2, reset_after=0.5)
    args.update(kw)
    return Bulkhead("database", **args)


@pytest.mark.latency
async def test_stalled_calls_time_out_then_fail_fast():
    release = threading.Event()
    b = _bulkhead()
    t0 = time.monotonic()
    with pytest.raises(DependencyUnavailable) as info:
        await b.call(release.wait, 30)
    assert 0.25 < time.monotonic() - t0 < 2.0
    assert info.value.kind == "database" and info.value.retry_after == 3
    with pytest.raises(DependencyUnavailable):
        await b.call(release.wait, 30)
    assert b.is_open and b.status() == "down"
    t0 = time.monotonic()
    with pytest.raises(DependencyUnavailable, match="breaker open"):
        await b.call(lambda: 1)
    assert time.monotonic() - t0 < 0.1  # no wait behind the stalled calls
    release.set()
    await asyncio.sleep(0.6)  # past reset_after, the stuck threads have ended
    assert await b.call(lambda: 42, timeout=10) == 42
    assert b.status() == "ok" and b.in_flight == 0
    b.shutdown()


@pytest.mark.latency
async def test_full_pool_refuses_at_once_and_other_bulkheads_serve():
    release = threading.Event()
    deps = Dependencies(DependencyPolicy(db_workers=1, db_call_timeout=5.0, breaker_failures=99))
    stuck = [asyncio.ensure_future(deps.db.call(release.wait, 30)) for _ in range(2)]
    await asyncio.sleep(0.1)
    t0 = time.monotonic()
    with pytest.raises(DependencyUnavailable, match="too many"):
        await deps.db.call(lambda: 1)
    assert time.monotonic() - t0 < 0.1
    assert await deps.store.call(lambda: "fetched") == "fetched"  # its own threads
    release.set()
    assert await asyncio.gather(*stuck) == [True, True]
    deps.shutdown()


async def test_dependency_errors_count_and_others_do_not():
    b = _bulkhead(failures=2, timeout=10.0)  # no deadline under test here

    def pg_down():
        raise OperationalError("SELECT 1", {}, Exception("refused"))

    with pytest.raises(KeyError):  # a missing row is not an outage
        await b.call(lambda: {}["x"])
    assert b.status() == "ok"
    for _ in range(2):
        with pytest.raises(OperationalError):
            await b.call(pg_down)
    assert b.is_open
    b.shutdown()


@pytest.mark.latency
def test_call_sync_deadline():
    b = _bulkhead(timeout=0.2)
    release = threading.Event()
    t0 = time.monotonic()
    with pytest.raises(DependencyUnavailable):
        b.call_sync(release.wait, 30)
    assert time.monotonic() - t0 < 1.5
    release.set()
    assert b.call_sync(lambda: 5, timeout=2) == 5
    b.shutdown()


def test_dependency_kind():
    import redis

    from loramux.registry.errors import ObjectNotFound, ObjectStoreError

    assert dependency_kind(OperationalError("x", {}, Exception())) == "database"
    assert dependency_kind(ObjectStoreError("x")) == "object store"
    assert dependency_kind(ObjectNotFound("x")) is None
    assert dependency_kind(redis.TimeoutError()) == "redis"
    assert dependency_kind(ValueError()) is None


def test_policy_and_budgets_are_settings():
    from loramux.platform.builders import dependency_budgets, dependency_policy
    from loramux.platform.settings import Settings

    s = Settings(s3_read_timeout=1.5, db_statement_timeout=2.0, db_workers=3,
                 breaker_reset=9.0)
    assert dependency_budgets(s).s3_read_timeout == 1.5
    assert dependency_budgets(s).db_statement_timeout == 2.0
    assert dependency_policy(s).db_workers == 3 and dependency_policy(s).breaker_reset == 9.0
    with pytest.raises(ValueError):
        DependencyPolicy(db_call_timeout=0)


@pytest.mark.latency
async def test_read_through_answers_stale_at_once_while_the_database_fails():
    deps = Dependencies(DependencyPolicy(outage_staleness=60, breaker_failures=99))
    cache = deps.stale_cache(0.0)  # every entry is expired at once
    calls = []
    release = threading.Event()

    async def load():
        calls.append(1)
        return await deps.db.call(lambda: f"v{len(calls)}" if release.wait(5) else None)

    release.set()
    assert await deps.read_through(cache, "k", load) == "v1"
    release.clear()
    deps.db.record_failure("the database stalled")  # the bulkhead is degraded now
    t0 = time.monotonic()
    assert await deps.read_through(cache, "k", load) == "v1"  # stale, not waited for
    assert time.monotonic() - t0 < 0.1
    await asyncio.sleep(0.01)
    assert len(calls) == 2  # one background refresh started ...
    assert await deps.read_through(cache, "k", load) == "v1"
    assert len(calls) == 2  # ... and only one per key at a time
    release.set()
    for _ in range(50):
        await asyncio.sleep(0.02)
        if cache.usable("k") == "v2":
            break
    assert cache.usable("k") == "v2"  # the refresh landed
    with pytest.raises(DependencyUnavailable):  # nothing cached: the error, not a guess
        deps.db.record_failure("x")
        await deps.read_through(cache, "other", lambda: deps.db.call(_raise_unavailable))
    deps.shutdown()


def _raise_unavailable():
    raise DependencyUnavailable("database", "down", 5)


@pytest.mark.latency
async def test_read_through_hedges_a_slow_refresh():
    deps = Dependencies(DependencyPolicy(stale_hedge=0.2, breaker_failures=99))
    cache = deps.stale_cache(0.0)
    cache.put("k", "old")
    assert await deps.read_through(cache, "k", lambda: _later("fast", 0.0)) == "fast"
    t0 = time.monotonic()
    assert await deps.read_through(cache, "k", lambda: _later("slow", 1.0)) == "fast"
    assert time.monotonic() - t0 < 0.6  # the hedge, not the 1 s refresh
    await asyncio.sleep(1.1)
    assert cache.usable("k") == "slow"  # the refresh landed in the background
    deps.shutdown()


async def _later(value, delay):
    await asyncio.sleep(delay)
    return value
