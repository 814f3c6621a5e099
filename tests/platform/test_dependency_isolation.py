"""One stalled dependency takes only its own bulkhead: a cold-adapter request fails within
the store's deadline with 503 + Retry-After while base-model requests stay fast; a key seen
before keeps working while the database is down (stale-on-error, bounded); ``/ready``
names the failing dependency (the reason for the admin key only) within its probe budget."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest
from sqlalchemy.exc import OperationalError
from support.platform_settings import ADMIN_KEY, BASE, settings

from loramux.platform.app import create_app
from loramux.platform.state import close_state


@pytest.fixture
async def fast_client(env):
    app = create_app(settings(store_call_timeout=1.0, db_call_timeout=1.0, breaker_failures=50),
                     engine=env.engine, registry=env.registry)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test",
                                 timeout=60) as c:
        yield c, app.services
    close_state(app.services)


def _stall(monkeypatch, obj, name, release: threading.Event):
    def stalled(*_a, **_k):
        release.wait(30)
        raise OperationalError("SELECT 1", {}, Exception("server at 10.9.8.7 closed"))
    monkeypatch.setattr(obj, name, stalled)


@pytest.mark.latency
async def test_stalled_store_fails_cold_adapters_fast_and_spares_the_base_model(
        fast_client, env, monkeypatch):
    client, _ = fast_client
    h = env.headers(env.key_b)
    env.registry.cache.prune(keep=())  # b-only is cold: the next use fetches it
    release = threading.Event()

    def stalled_get(*_a, **_k):
        release.wait(30)
        raise OSError("unreachable")
    monkeypatch.setattr(env.registry.store, "get_file", stalled_get)
    base = {"model": BASE, "prompt": "hello", "max_tokens": 2}
    idle = time.monotonic()
    assert (await client.post("/v1/completions", headers=h, json=base)).status_code == 200
    idle = time.monotonic() - idle
    try:
        cold = [asyncio.ensure_future(client.post(
            "/v1/completions", headers=h, json={**base, "model": "b-only"})) for _ in range(6)]
        await asyncio.sleep(0.2)
        t0 = time.monotonic()
        r = await client.post("/v1/completions", headers=h, json=base)
        assert r.status_code == 200 and time.monotonic() - t0 < max(3 * idle, 1.0)
        t0 = time.monotonic()
        answers = await asyncio.gather(*cold)
        assert time.monotonic() - t0 < 3.0  # the store's deadline (1 s), not the stall (30 s)
        for a in answers:
            assert a.status_code == 503 and a.headers["retry-after"]
            assert a.json()["error"]["code"] == "object_store_unavailable"
        assert (await client.get("/v1/adapters", headers=h)).status_code == 200
    finally:
        release.set()
        monkeypatch.undo()
    r = await client.post("/v1/completions", headers=h, json={**base, "model": "b-only"})
    assert r.status_code == 200  # back without a restart


async def test_cached_key_survives_a_database_outage(fast_client, env, monkeypatch):
    client, state = fast_client
    body = {"model": BASE, "prompt": "hi", "max_tokens": 1}
    assert (await client.post("/v1/completions", headers=env.headers(env.key_a),
                              json=body)).status_code == 200
    state.auth._cache.ttl = 0.0  # the key's cache entry has expired
    release = threading.Event()
    _stall(monkeypatch, env.registry, "authenticate_key", release)
    release.set()  # the database refuses at once
    r = await client.post("/v1/completions", headers=env.headers(env.key_a), json=body)
    assert r.status_code == 200, r.text  # served from the last good lookup
    r = await client.post("/v1/completions", headers=env.headers("lmx_never_seen_key"), json=body)
    assert r.status_code == 503 and r.json()["error"]["code"] == "database_unavailable"
    assert "10.9.8.7" not in r.text


@pytest.mark.latency
async def test_ready_names_the_stalled_database(fast_client, env, monkeypatch):
    client, _ = fast_client
    release = threading.Event()
    _stall(monkeypatch, env.registry.db, "ping", release)
    try:
        t0 = time.monotonic()
        r = await client.get("/ready")
        assert time.monotonic() - t0 < 2.5
        assert r.status_code == 200 and r.json()["status"] == "degraded"
        assert r.json()["dependencies"]["database"] == "down"
        assert r.json()["dependencies"]["object store"] == "ok"
        assert r.json()["reasons"] is None
        r = await client.get("/ready", headers={"Authorization": f"Bearer {ADMIN_KEY}"})
        assert "database" in r.json()["reasons"]
    finally:
        release.set()
    monkeypatch.undo()
    await asyncio.sleep(0.1)
    r = await client.get("/ready")
    assert r.json()["dependencies"]["database"] in ("ok", "degraded")
