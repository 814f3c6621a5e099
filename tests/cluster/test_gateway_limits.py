"""A gateway applies its tenants' quotas before anything else (in-process, no engines: a
request the limiter admits then finds no model): 429 + Retry-After past the limit, the
limit shared through Redis by two gateways, and served on when the limiter's Redis is down."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from support.server import free_port

from loramux.platform.cluster.roles import build_gateway_app
from loramux.platform.settings import Settings
from loramux.registry import build_registry
from loramux.registry.quotas import Quotas


@pytest.fixture
def limited(tmp_path):
    reg = build_registry(data_dir=tmp_path)
    tenant, key = reg.create_tenant("limited")
    reg.set_quotas(tenant.id, Quotas(requests_per_minute=2))
    _, free_key = reg.create_tenant("free")
    reg.db.dispose()
    return tmp_path, key, free_key


def gateway(data_dir, redis_url: str, namespace: str) -> TestClient:
    s = Settings(role="gateway", redis_url=redis_url, redis_namespace=namespace,
                 cluster_secret="s3cret", data_dir=data_dir, admin_key="admin",
                 heartbeat_interval=0.2)
    return TestClient(build_gateway_app(s))


def ask(client: TestClient, key: str):
    return client.post("/v1/chat/completions", json={"model": "m", "messages": []},
                       headers={"Authorization": f"Bearer {key}"})


def test_two_gateways_share_one_bucket(limited, redis_url, namespace):
    data, key, free_key = limited
    with gateway(data, redis_url, namespace) as a, gateway(data, redis_url, namespace) as b:
        assert ask(a, key).status_code == 404  # admitted, then: no engine serves `m`
        assert ask(b, key).status_code == 404
        for client in (a, b):
            r = ask(client, key)
            assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limit_exceeded"
            assert 1 <= int(r.headers["retry-after"]) <= 31
        assert ask(a, free_key).status_code == 404  # no quotas, no limit


def test_limiter_redis_down_serves_on(limited):
    data, key, _ = limited
    with gateway(data, f"redis://127.0.0.1:{free_port()}/0", "lmx-down") as gw:
        for _ in range(4):  # past the limit, but nobody can count: served (and logged)
            assert ask(gw, key).status_code == 404
        ready = gw.get("/ready").json()
        assert ready["status"] in ("degraded", "no engines")
        assert ready["dependencies"] == {"redis": "down", "database": "ok"}
        assert ready["redis"] == "unreachable"  # the address only in the log
