"""Admin dashboard and API (residency, evict / pin / unpin / warm), health, readiness and
Prometheus metrics with per-adapter labels."""

from __future__ import annotations

import re

from support.platform_settings import ADMIN_KEY, BASE

ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


def _row(data: dict, name: str) -> dict:
    (row,) = [r for r in data["data"] if r.get("adapter") == name]
    return row


def _metric(text: str, name: str, **labels) -> float | None:
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        got = dict(re.findall(r'(\w+)="([^"]*)"', line.split(" ")[0]))
        if all(got.get(k) == v for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return None


async def test_dashboard_page_and_auth(client, env):
    page = await client.get("/admin")
    assert page.status_code == 303 and page.headers["location"] == "/admin/login"
    login = await client.get("/admin/login")
    assert login.status_code == 200 and "text/html" in login.headers["content-type"]
    assert "Admin key" in login.text
    assert (await client.get("/admin/adapters")).status_code == 401
    r = await client.get("/admin/adapters", headers=env.headers(env.key_a))
    assert r.status_code == 403  # a tenant key is not the admin key
    r = await client.post("/v1/completions", headers=ADMIN, json={"model": BASE, "prompt": "x"})
    assert r.status_code == 200  # the admin key may use shared models


async def test_residency_and_actions(client, env):
    data = (await client.get("/admin/adapters", headers=ADMIN)).json()
    row = _row(data, "b-only")
    assert row["tenant"] == "beta" and row["source"] == "registry"
    key = row["key"]
    assert key.startswith(f"{env.tenant_b.id}/b-only@")
    assert data["engine"]["max_loras"] == 2

    r = await client.post(f"/admin/adapters/{key}/warm", headers=ADMIN)
    assert r.status_code == 200 and r.json()["done"] is True
    row = _row((await client.get("/admin/adapters", headers=ADMIN)).json(), "b-only")
    assert row["tier"] == "device" and row["slot"] is not None and row["load_seconds"] > 0
    assert row["slot_seconds"] is not None  # CPU tier → slot, timed apart from the disk
    loads = (await client.get("/admin/adapters", headers=ADMIN)).json()["engine"]["adapter_loads"]
    assert loads["disk"]["loads"] >= 1 and loads["cpu"]["loads"] >= 1

    assert (await client.post(f"/admin/adapters/{key}/pin", headers=ADMIN)).status_code == 200
    assert _row((await client.get("/admin/adapters", headers=ADMIN)).json(), "b-only")["pinned"]
    assert (await client.post(f"/admin/adapters/{key}/unpin", headers=ADMIN)).status_code == 200
    assert not _row((await client.get("/admin/adapters", headers=ADMIN)).json(), "b-only")["pinned"]

    r = await client.post(f"/admin/adapters/{key}/evict", headers=ADMIN)
    assert r.status_code == 200 and r.json()["done"] is True
    row = _row((await client.get("/admin/adapters", headers=ADMIN)).json(), "b-only")
    assert row["tier"] == "cpu" and row["slot"] is None
    events = env.registry.events(env.tenant_b.id, adapter_name="b-only")
    assert events[0].kind == "evicted" and events[0].actor == "admin"

    metrics = (await client.get("/metrics", headers=ADMIN)).text
    assert _metric(metrics, "loramux_adapter_evictions_total", adapter=key) >= 1
    assert _metric(metrics, "loramux_adapter_residency", adapter=key, tier="cpu") == 1.0
    assert _metric(metrics, "loramux_adapter_residency", adapter=key, tier="device") == 0.0
    assert _metric(metrics, "loramux_adapter_load_seconds", adapter=key) > 0
    assert _metric(metrics, "loramux_adapter_slot_seconds", adapter=key) >= 0
    assert _metric(metrics, "loramux_adapter_tier_loads", tier="disk") >= 1
    assert _metric(metrics, "loramux_adapter_tier_load_seconds", tier="disk") > 0

    assert (await client.post("/admin/adapters/9/none@x/warm", headers=ADMIN)).status_code == 404
    r = await client.post(f"/admin/adapters/{key}/evict", headers=env.headers(env.key_b))
    assert r.status_code == 403


async def test_request_metrics_per_adapter(client, env):
    h = env.headers(env.key_a)
    for model in (BASE, "a-only"):
        r = await client.post("/v1/completions", headers=h,
                              json={"model": model, "prompt": "count", "max_tokens": 5, "temperature": 0})
        assert r.status_code == 200
    r = await client.post("/v1/chat/completions", headers=h, json={
        "model": "a-only", "messages": [{"role": "user", "content": "x"}], "max_tokens": 3,
        "stream": True})
    assert r.status_code == 200
    text = (await client.get("/metrics", headers=ADMIN)).text
    key = _row((await client.get("/admin/adapters", headers=ADMIN)).json(), "a-only")["key"]
    assert _metric(text, "loramux_requests_total", adapter=key, endpoint="completions", status="ok") >= 1
    assert _metric(text, "loramux_requests_total", adapter=key, endpoint="chat", status="ok") >= 1
    assert _metric(text, "loramux_requests_total", adapter="base", endpoint="completions") >= 1
    assert _metric(text, "loramux_generated_tokens_total", adapter=key) >= 8
    assert _metric(text, "loramux_time_to_first_token_seconds_count", adapter=key) >= 2
    assert _metric(text, "loramux_time_per_output_token_seconds_count", adapter=key) >= 2
    assert _metric(text, "loramux_kv_cache_usage_perc") == 0.0
    assert _metric(text, "loramux_num_requests_waiting") == 0.0
    assert _metric(text, "loramux_num_requests_running") == 0.0


async def test_prefix_cache_hit_rate_metric(client, env):
    body = {"model": BASE, "prompt": "one two three four five six seven eight " * 8, "max_tokens": 1}
    for _ in range(2):
        r = await client.post("/v1/completions", headers=env.headers(env.key_a), json=body)
        assert r.status_code == 200
    assert 0.0 < _metric((await client.get("/metrics", headers=ADMIN)).text, "loramux_prefix_cache_hit_rate") <= 1.0


async def test_health_and_ready(client):
    assert (await client.get("/health")).json() == {"status": "ok"}
    r = await client.get("/ready")
    assert r.status_code == 200 and r.json()["checks"] == {"engine": True, "accepting": True,
                                                           "registry": True}
    assert r.json()["status"] == "ready"
    assert r.json()["dependencies"] == {"database": "ok", "object store": "ok"}
