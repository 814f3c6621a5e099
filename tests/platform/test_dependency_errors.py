"""A failed dependency is 503 + Retry-After naming its kind only, through the one error
table: no host, bucket, key or digest in the body, the details in the log; services raise
and do not translate. Over a real uvicorn server the connection is not reset."""

from __future__ import annotations

import logging

import httpx
import pytest
from sqlalchemy.exc import OperationalError
from support.server import serve_in_thread

from loramux.platform.bulkheads import DependencyUnavailable
from loramux.registry.errors import ObjectStoreError

SECRET_HOST = "db-primary.internal.example:5432"


def _pg_down(*_a, **_k):
    raise OperationalError("SELECT 1", {}, Exception(
        f'connection to server at "{SECRET_HOST}" failed: Connection refused'))


@pytest.mark.parametrize("exc, code", [
    (lambda: _pg_down(), "database_unavailable"),
    (lambda: (_ for _ in ()).throw(ObjectStoreError(
        "S3 download of 'adapters/sha256/ab' in bucket 'private-bucket-7' at "
        "http://10.0.0.7:9000 failed")), "object_store_unavailable"),
    (lambda: (_ for _ in ()).throw(DependencyUnavailable("database", "pool full", 7)),
     "database_unavailable"),
])
async def test_dependency_failure_is_503_with_retry_after(client, env, monkeypatch, caplog,
                                                          exc, code):
    monkeypatch.setattr(env.registry, "list", lambda *_a, **_k: exc())
    with caplog.at_level(logging.ERROR):
        r = await client.get("/v1/adapters", headers=env.headers(env.key_a))
    assert r.status_code == 503, r.text
    body = r.json()["error"]
    assert body["code"] == code and body["type"] == "server_error"
    assert int(r.headers["retry-after"]) >= 1
    for secret in (SECRET_HOST, "private-bucket-7", "10.0.0.7", "adapters/sha256"):
        assert secret not in r.text
    assert "unavailable" in caplog.text  # logged in full server-side
    if code == "database_unavailable" and "pool full" not in caplog.text:
        assert SECRET_HOST in caplog.text


async def test_redis_failure_maps_through_the_table(client, env, monkeypatch):
    import redis

    def down(*_a, **_k):
        raise redis.ConnectionError("Error 111 connecting to 10.1.2.3:6379")

    monkeypatch.setattr(env.registry, "list", down)
    r = await client.get("/v1/adapters", headers=env.headers(env.key_a))
    assert r.status_code == 503 and r.json()["error"]["code"] == "redis_unavailable"
    assert "10.1.2.3" not in r.text and r.headers["retry-after"]


def test_database_outage_keeps_the_connection(app, env, monkeypatch, caplog):
    """uvicorn: the 503 is answered and the keep-alive connection serves the next request
    (an ``Exception`` handler alone re-raised: "Exception in ASGI application", reset)."""
    calls = {"n": 0}
    real = env.registry.list

    def flaky(*a, **k):
        calls["n"] += 1
        if calls["n"] == 1:
            _pg_down()
        return real(*a, **k)

    monkeypatch.setattr(env.registry, "list", flaky)
    with caplog.at_level(logging.ERROR), serve_in_thread(app) as url, \
            httpx.Client(base_url=url, timeout=30) as c:
        first = c.get("/v1/adapters", headers=env.headers(env.key_a))
        second = c.get("/v1/adapters", headers=env.headers(env.key_a))
        boom = {"n": 0}

        def unexpected(*_a, **_k):
            boom["n"] += 1
            raise RuntimeError("bug")
        monkeypatch.setattr(env.registry, "list", unexpected)
        third = c.get("/v1/adapters", headers=env.headers(env.key_a))
        monkeypatch.setattr(env.registry, "list", real)
        fourth = c.get("/v1/adapters", headers=env.headers(env.key_a))
    assert first.status_code == 503 and second.status_code == 200
    assert third.status_code == 500 and fourth.status_code == 200 and boom["n"] == 1
    assert "Exception in ASGI application" not in caplog.text
