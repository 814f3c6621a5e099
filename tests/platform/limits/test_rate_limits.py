"""TenantLimiter over both backends: in-process and the real Redis server (its own key
prefix per test). Each limit denies with its name and a retry_after, charges nothing when
denied, survives racing gateways, and a lease dies with a gateway that died holding it."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from loramux.platform.limits.backend import Ask
from loramux.platform.limits.memory import InProcessBackend
from loramux.platform.limits.redis_backend import RedisBackend
from loramux.platform.limits.tenant import (
    LimiterUnavailable,
    RateLimited,
    RequestCost,
    RequestTooLarge,
    TenantLimiter,
    build_limiter,
)
from loramux.registry.quotas import Quotas


@pytest.fixture(params=["memory", "redis"])
async def make_backend(request):
    """``make_backend()`` → one gateway's backend; all share the same limits state."""
    made: list[RedisBackend] = []
    if request.param == "memory":
        shared = InProcessBackend()

        def make():
            return shared

        yield make
        return
    import redis.asyncio

    url = request.getfixturevalue("redis_url")
    prefix = f"lmx-test:{uuid.uuid4().hex}:"

    def make():
        made.append(RedisBackend.from_url(url, prefix))
        return made[-1]

    yield make
    client = redis.asyncio.Redis.from_url(url)
    async for key in client.scan_iter(match=f"{prefix}*"):
        await client.delete(key)
    await client.aclose()
    for backend in made:
        await backend.aclose()


async def admit_once(limiter, quotas, cost=RequestCost(1), tenant="t1"):
    async with limiter.hold(tenant, quotas, cost):
        pass


async def test_requests_per_minute(make_backend):
    limiter = TenantLimiter(make_backend())
    q = Quotas(requests_per_minute=3)
    for _ in range(3):
        await admit_once(limiter, q)
    with pytest.raises(RateLimited) as e:
        await admit_once(limiter, q)
    assert e.value.limit == "requests_per_minute"
    assert 19.0 < e.value.retry_after <= 20.0  # one request per 20 s
    assert e.value.retry_after_header == "20"
    await admit_once(limiter, q, tenant="t2")  # another tenant has its own bucket


async def test_tokens_per_minute_with_correction_and_debt(make_backend):
    limiter = TenantLimiter(make_backend())
    q = Quotas(tokens_per_minute=100)
    async with limiter.hold("t1", q, RequestCost(60)) as hold:
        hold.charge(10)  # used far less than estimated: 50 come back at exit
    async with limiter.hold("t1", q, RequestCost(60)):
        pass
    with pytest.raises(RateLimited) as e:  # 30 left, 60 needed: 30 tokens at 100/min
        await admit_once(limiter, q, RequestCost(60))
    assert e.value.limit == "tokens_per_minute"
    assert 17.0 < e.value.retry_after <= 18.0
    # a request larger than the bucket waits for a full bucket, then leaves a debt
    with pytest.raises(RateLimited):
        await admit_once(limiter, q, RequestCost(500))
    await admit_once(limiter, q, RequestCost(500), tenant="t2")
    with pytest.raises(RateLimited) as e:
        await admit_once(limiter, q, RequestCost(1), tenant="t2")
    assert 240.0 < e.value.retry_after <= 241.0  # (1 + 400) tokens at 100/min


async def test_a_denial_charges_nothing(make_backend):
    limiter = TenantLimiter(make_backend())
    q = Quotas(requests_per_minute=2, tokens_per_minute=100)
    await admit_once(limiter, q, RequestCost(100))
    for _ in range(3):
        with pytest.raises(RateLimited, match="tokens_per_minute"):
            await admit_once(limiter, q, RequestCost(50))
    await admit_once(limiter, Quotas(requests_per_minute=2), RequestCost(50))  # 1 request left
    with pytest.raises(RateLimited, match="requests_per_minute"):
        await admit_once(limiter, Quotas(requests_per_minute=2), RequestCost(50))


async def test_concurrency_and_sequences(make_backend):
    limiter = TenantLimiter(make_backend(), busy_retry_after_s=2.5)
    q = Quotas(max_concurrent_requests=2, max_queued_sequences=8)
    async with limiter.hold("t1", q, RequestCost(1, sequences=5)):
        with pytest.raises(RateLimited) as e:
            await admit_once(limiter, q, RequestCost(1, sequences=4))
        assert (e.value.limit, e.value.retry_after) == ("max_queued_sequences", 2.5)
        async with limiter.hold("t1", q, RequestCost(1, sequences=3)):
            with pytest.raises(RateLimited) as e:
                await admit_once(limiter, q)
            assert e.value.limit == "max_concurrent_requests"
            await admit_once(limiter, q, tenant="t2")
        await admit_once(limiter, q, RequestCost(1, sequences=3))
    await admit_once(limiter, q, RequestCost(1, sequences=8))
    with pytest.raises(RequestTooLarge, match="needs 9 sequences") as e:
        await admit_once(limiter, q, RequestCost(1, sequences=9))
    assert (e.value.limit, e.value.requested, e.value.allowed) == ("max_queued_sequences", 9, 8)


async def test_released_on_error_and_cancellation(make_backend):
    limiter = TenantLimiter(make_backend())
    q = Quotas(max_concurrent_requests=1)
    with pytest.raises(KeyError):
        async with limiter.hold("t1", q, RequestCost(1)):
            raise KeyError("boom")
    entered = asyncio.Event()

    async def hold():
        async with limiter.hold("t1", q, RequestCost(1)):
            entered.set()
            await asyncio.sleep(60)

    task = asyncio.create_task(hold())
    await entered.wait()
    with pytest.raises(RateLimited):
        await admit_once(limiter, q)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await admit_once(limiter, q)


async def test_racing_gateways_never_exceed_the_limit(make_backend):
    """40 requests through 4 gateways (4 Redis connections) at once, 5 slots."""
    limiters = [TenantLimiter(make_backend()) for _ in range(4)]
    q = Quotas(max_concurrent_requests=5, max_queued_sequences=50)
    inside, peak, admitted = 0, 0, 0
    release = asyncio.Event()

    async def one(limiter):
        nonlocal inside, peak, admitted
        try:
            async with limiter.hold("t1", q, RequestCost(1, sequences=2)):
                inside += 1
                admitted += 1
                peak = max(peak, inside)
                await release.wait()
                inside -= 1
        except RateLimited as e:
            assert e.limit == "max_concurrent_requests"

    tasks = [asyncio.create_task(one(limiters[i % 4])) for i in range(40)]
    for _ in range(200):
        await asyncio.sleep(0.01)
        if sum(t.done() for t in tasks) == 35:
            break
    release.set()
    await asyncio.gather(*tasks)
    assert admitted == 5 and peak == 5
    await asyncio.gather(*(admit_once(limiters[0], q) for _ in range(5)))  # all slots back


async def test_lease_of_a_dead_gateway_expires(make_backend):
    backend = make_backend()
    dead = Ask(lease="crashed", lease_ttl_s=0.3, requests_per_minute=None,
               tokens_per_minute=None, tokens=0, max_concurrent_requests=1,
               max_queued_sequences=None, sequences=1)
    assert (await backend.acquire("t1", dead)).allowed  # never released, never renewed
    limiter = TenantLimiter(backend)
    q = Quotas(max_concurrent_requests=1)
    with pytest.raises(RateLimited):
        await admit_once(limiter, q)
    await asyncio.sleep(0.4)
    await admit_once(limiter, q)
    assert not await backend.renew("t1", "crashed", 10.0)


async def test_a_live_lease_is_renewed(make_backend):
    """A request running for several TTLs keeps its slot; it frees it when it ends."""
    limiter = TenantLimiter(make_backend(), lease_ttl_s=0.3)
    q = Quotas(max_concurrent_requests=1)
    async with limiter.hold("t1", q, RequestCost(1)):
        for _ in range(4):
            await asyncio.sleep(0.25)
            with pytest.raises(RateLimited):
                await admit_once(limiter, q)
    await admit_once(limiter, q)


async def test_unlimited_quotas_skip_the_backend():
    class Refuses:
        async def acquire(self, key, ask):
            raise AssertionError("the backend was asked")

    limiter = TenantLimiter(Refuses())  # type: ignore[arg-type]
    async with limiter.hold("t1", Quotas(max_adapters=1), RequestCost(10**9, 10**6)):
        pass


def test_request_cost_estimate():
    assert RequestCost.estimate(100, 16) == RequestCost(116, 1)
    assert RequestCost.estimate(100, 16, n=2, best_of=4) == RequestCost(164, 4)
    with pytest.raises(ValueError):
        RequestCost(1, sequences=0)


async def test_redis_keys_expire(redis_url):
    backend = RedisBackend.from_url(redis_url, f"lmx-test:{uuid.uuid4().hex}:")
    limiter = TenantLimiter(backend, lease_ttl_s=5.0)
    q = Quotas(max_concurrent_requests=3, requests_per_minute=10, tokens_per_minute=1000)
    async with limiter.hold("t1", q, RequestCost(50)) as hold:
        hold.charge(20)
        client = backend.client
        for key in backend.keys("t1"):
            assert 0 < await client.pttl(key) <= 70_000, key
    bucket, leases, _ = backend.keys("t1")
    assert await client.pttl(bucket) > 0
    assert await client.zcard(leases) == 0
    for key in backend.keys("t1"):
        await client.delete(key)
    await backend.aclose()


async def test_build_limiter_and_an_unreachable_redis(redis_url):
    assert isinstance(build_limiter(None).backend, InProcessBackend)
    limiter = build_limiter(redis_url, lease_ttl_s=5.0)
    assert isinstance(limiter.backend, RedisBackend) and limiter.lease_ttl_s == 5.0
    await limiter.aclose()
    down = build_limiter("redis://127.0.0.1:1/0")  # nothing listens on port 1
    with pytest.raises(LimiterUnavailable, match="unavailable"):
        await admit_once(down, Quotas(requests_per_minute=1))
    await down.aclose()
