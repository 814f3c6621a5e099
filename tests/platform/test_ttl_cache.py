"""The one TTL cache: expiry, bounds, read-through, and stale-on-error."""

from __future__ import annotations

import asyncio

import pytest

from loramux.platform.ttl_cache import TTLCache


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class DependencyDown(RuntimeError):
    pass


def test_entries_expire_after_ttl():
    clock = Clock()
    cache = TTLCache(ttl=5.0, clock=clock)
    cache.put("a", 1)
    clock.now += 4.9
    assert cache.get("a") == 1 and "a" in cache
    clock.now += 0.2
    assert cache.get("a") is None and "a" not in cache
    assert cache.get("a", "gone") == "gone"


def test_read_through_loads_once_while_fresh_and_again_after():
    clock = Clock()
    cache = TTLCache(ttl=1.0, clock=clock)
    calls = []

    def load():
        calls.append(1)
        return len(calls)

    assert cache.get_or_load("k", load) == 1
    assert cache.get_or_load("k", load) == 1
    clock.now += 1.0
    assert cache.get_or_load("k", load) == 2
    assert len(calls) == 2


def test_none_is_cached_unless_told_not_to():
    calls = []

    def load():
        calls.append(1)

    keeps = TTLCache(ttl=10.0)
    keeps.get_or_load("k", load)
    keeps.get_or_load("k", load)
    assert len(calls) == 1
    skips = TTLCache(ttl=10.0, cache_none=False)
    skips.get_or_load("k", load)
    skips.get_or_load("k", load)
    assert len(calls) == 3


def test_bounded_drops_expired_then_oldest():
    clock = Clock()
    cache = TTLCache(ttl=10.0, maxsize=3, clock=clock)
    cache.put("old", 0)
    clock.now += 11
    cache.put("a", 1)
    cache.put("b", 2)
    cache.put("c", 3)  # full: the expired "old" goes, nothing else
    assert len(cache) == 3 and cache.get("a") == 1
    cache.put("d", 4)  # full of fresh entries: the oldest ("a") goes
    assert cache.get("a") is None and [cache.get(k) for k in "bcd"] == [2, 3, 4]


def test_discard_where_pop_and_clear():
    cache = TTLCache(ttl=10.0)
    for key in [(1, "x"), (1, "y"), (2, "x")]:
        cache.put(key, key)
    cache.discard_where(lambda k: k[0] == 1)
    assert len(cache) == 1 and cache.get((2, "x")) == (2, "x")
    cache.pop((2, "x"))
    cache.pop("absent")
    assert len(cache) == 0
    cache.put("z", 1)
    cache.clear()
    assert len(cache) == 0


def test_stale_on_error_serves_last_good_value_for_a_bounded_time():
    clock = Clock()
    cache = TTLCache(ttl=5.0, stale_for=30.0, stale_on=(DependencyDown,), clock=clock)
    assert cache.get_or_load("key", lambda: "caller") == "caller"

    def down():
        raise DependencyDown("db unreachable")

    clock.now += 6  # expired, within the stale window
    assert cache.get_or_load("key", down) == "caller"
    clock.now += 30  # past ttl + stale_for
    with pytest.raises(DependencyDown):
        cache.get_or_load("key", down)
    with pytest.raises(DependencyDown):  # never loaded: nothing to fall back on
        cache.get_or_load("other", down)


def test_stale_on_error_never_hides_other_errors_and_is_off_by_default():
    clock = Clock()
    guarded = TTLCache(ttl=1.0, stale_for=60.0, stale_on=(DependencyDown,), clock=clock)
    plain = TTLCache(ttl=1.0, clock=clock)
    for cache in (guarded, plain):
        cache.put("k", "v")
    clock.now += 2

    def bug():
        raise KeyError("not a dependency error")

    with pytest.raises(KeyError):
        guarded.get_or_load("k", bug)

    def down():
        raise DependencyDown("db")

    with pytest.raises(DependencyDown):
        plain.get_or_load("k", down)


def test_async_read_through_and_stale_on_error():
    clock = Clock()
    cache = TTLCache(ttl=1.0, stale_for=10.0, stale_on=(DependencyDown,), clock=clock)

    async def good():
        return "fresh"

    async def down():
        raise DependencyDown("redis")

    async def scenario():
        assert await cache.aget_or_load("k", good) == "fresh"
        clock.now += 2
        assert await cache.aget_or_load("k", down) == "fresh"
        clock.now += 10
        with pytest.raises(DependencyDown):
            await cache.aget_or_load("k", down)

    asyncio.run(scenario())


@pytest.mark.parametrize("kwargs", [{"ttl": -1}, {"ttl": 1, "maxsize": 0}, {"ttl": 1, "stale_for": -1}])
def test_bad_arguments_are_refused(kwargs):
    with pytest.raises(ValueError):
        TTLCache(**kwargs)


def test_concurrent_misses_share_one_load():
    cache = TTLCache(ttl=10.0)
    calls = []

    async def slow():
        calls.append(1)
        await asyncio.sleep(0.05)
        return "v"

    async def scenario():
        got = await asyncio.gather(*(cache.aget_or_load("k", slow) for _ in range(50)))
        assert got == ["v"] * 50 and len(calls) == 1
        other = await asyncio.gather(cache.aget_or_load("a", slow), cache.aget_or_load("b", slow))
        assert other == ["v", "v"] and len(calls) == 3  # other keys load on their own

    asyncio.run(scenario())


def test_a_shared_load_failure_reaches_every_waiter_and_is_not_cached():
    cache = TTLCache(ttl=10.0)
    calls = []

    async def broken():
        calls.append(1)
        await asyncio.sleep(0.02)
        raise DependencyDown("db")

    async def good():
        return "ok"

    async def scenario():
        got = await asyncio.gather(*(cache.aget_or_load("k", broken) for _ in range(5)),
                                   return_exceptions=True)
        assert all(isinstance(g, DependencyDown) for g in got) and len(calls) == 1
        assert await cache.aget_or_load("k", good) == "ok"

    asyncio.run(scenario())


def test_waiters_load_themselves_when_the_loading_caller_is_cancelled():
    cache = TTLCache(ttl=10.0)
    started = []

    async def slow():
        started.append(1)
        await asyncio.sleep(0.2 if len(started) == 1 else 0)
        return len(started)

    async def scenario():
        first = asyncio.create_task(cache.aget_or_load("k", slow))
        await asyncio.sleep(0.01)
        second = asyncio.create_task(cache.aget_or_load("k", slow))
        await asyncio.sleep(0.01)
        first.cancel()
        assert await second == 2  # not the first caller's cancellation
        with pytest.raises(asyncio.CancelledError):
            await first

    asyncio.run(scenario())
