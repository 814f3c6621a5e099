"""The admin JSON API and the dashboard's session: auth (401 / 403), login cookie flags,
CSRF refusal, the views (overview, adapters, tenants, audit), each action, deferred
eviction while a request uses the adapter, recent 429s, and the key never in a log."""

from __future__ import annotations

import asyncio
import logging
import re

import httpx
from support.platform_settings import ADMIN_KEY, BASE, settings
from support.server import make_engine

from loramux.platform.app import create_app
from loramux.platform.state import close_state

ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
VIEWS = ("/admin/overview", "/admin/adapters", "/admin/tenants", "/admin/events")


def _row(data: dict, name: str) -> dict:
    (row,) = [r for r in data["data"] if r.get("adapter") == name]
    return row


async def _login(client) -> str:
    """Log in through the form; returns the CSRF token the pages carry."""
    r = await client.post("/admin/login", data={"key": ADMIN_KEY})
    assert r.status_code == 303 and r.headers["location"] == "/admin"
    page = await client.get("/admin")
    assert page.status_code == 200
    return page.text.split('name="csrf-token" content="', 1)[1].split('"', 1)[0]


async def test_auth_401_403(client, env):
    for path in VIEWS:
        assert (await client.get(path)).status_code == 401, path
        assert (await client.get(path, headers=env.headers("lmx_wrong"))).status_code == 401
        r = await client.get(path, headers=env.headers(env.key_a))
        assert r.status_code == 403 and r.json()["error"]["type"] == "permission_error", path
        assert (await client.get(path, headers=ADMIN)).status_code == 200, path
    assert (await client.post("/admin/adapters/x/warm")).status_code == 401
    for path in ("/admin", "/admin/ui/adapters", "/admin/ui/tenants", "/admin/ui/audit"):
        r = await client.get(path)
        assert r.status_code == 303 and r.headers["location"] == "/admin/login", path


async def test_login_cookie_and_csrf(client, env, caplog):
    caplog.set_level(logging.DEBUG)
    r = await client.post("/admin/login", data={"key": env.key_a})
    assert r.status_code == 403 and "loramux_admin" not in r.headers.get("set-cookie", "")
    r = await client.post("/admin/login", data={"key": "nope"})
    assert r.status_code == 401
    r = await client.post("/admin/login", data={"key": ADMIN_KEY})
    cookie = r.headers["set-cookie"].lower()
    assert "httponly" in cookie and "samesite=strict" in cookie and "path=/admin" in cookie
    assert ADMIN_KEY.lower() not in cookie and ADMIN_KEY not in r.headers["location"]
    token = await _login(client)

    data = (await client.get("/admin/adapters")).json()  # the session cookie reads
    key = _row(data, "b-only")["key"]
    r = await client.post(f"/admin/adapters/{key}/warm")  # no CSRF token: refused
    assert r.status_code == 403 and r.json()["error"]["code"] == "csrf_failed"
    r = await client.post(f"/admin/adapters/{key}/warm", headers={"X-CSRF-Token": "forged"})
    assert r.status_code == 403
    assert _row((await client.get("/admin/adapters")).json(), "b-only")["tier"] != "device"
    r = await client.post(f"/admin/adapters/{key}/warm", headers={"X-CSRF-Token": token})
    assert r.status_code == 200 and r.json()["done"] is True
    overview = (await client.get("/admin")).text  # per-tier load counts and times
    assert "loads disk → CPU" in overview and "loads CPU → slot" in overview
    assert 'data-dependency="database"' in overview  # the dependencies' state
    assert re.search(r"goodput \(TTFT ≤ [\d.]+ ms and TPOT ≤ [\d.]+ ms\)", overview)
    adapters_page = (await client.get("/admin/ui/adapters")).text
    row_html = adapters_page.split(key, 1)[1].split("</tr>", 1)[0]
    assert re.search(r"disk \d+ ms\s*<br>slot [\d.]+ ms", row_html)  # its load column
    r = await client.post(f"/admin/adapters/{key}/evict", headers={"X-CSRF-Token": token})
    assert r.status_code == 200

    assert (await client.post("/admin/logout")).status_code == 403
    assert (await client.post("/admin/logout", headers={"X-CSRF-Token": token})).status_code == 204
    client.cookies.clear()
    assert (await client.get("/admin/adapters")).status_code == 401
    assert ADMIN_KEY not in caplog.text


async def test_pages_render(client, env):
    await _login(client)
    page = (await client.get("/admin")).text
    assert "device slots" in page and "prefix-cache hits" in page and "n/a" not in page
    assert "float32" in page
    page = (await client.get("/admin/ui/adapters?tenant=beta&sort=tokens&desc=true")).text
    assert "b-only" in page and "sql-lora" not in page and "<svg" in page
    page = (await client.get("/admin/ui/tenants")).text
    assert "alpha" in page and "max_stored_bytes" in page and env.key_a not in page
    assert env.key_a[:16] in page  # the prefix only
    page = (await client.get("/admin/ui/audit?kind=uploaded")).text
    assert "<td>sql-lora</td>" in page and "<td>key_created</td>" not in page


async def test_overview_tenants_and_keys(client, env):
    o = (await client.get("/admin/overview", headers=ADMIN)).json()
    assert o["dtype"] == "float32" and o["device"] == "cpu"
    assert o["weight_format"] == "float" and o["weight_bytes"] > 0
    (engine,) = o["engines"]
    assert engine["max_loras"] == 2 and 0.0 <= engine["prefix_cache_hit_rate"] <= 1.0
    assert o["dependencies"] == {"database": "ok", "object store": "ok"}

    r = await client.post("/v1/completions", headers=env.headers(env.key_a),
                          json={"model": "a-only", "prompt": "x", "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200
    goodput = (await client.get("/admin/overview", headers=ADMIN)).json()["goodput"]
    assert goodput["checked"] >= 1 and goodput["met"] <= goodput["checked"]
    assert goodput["share"] == goodput["met"] / goodput["checked"]
    assert goodput["tenants"]["alpha"]["checked"] >= 1  # by tenant name
    tenants = {t["name"]: t for t in (await client.get("/admin/tenants", headers=ADMIN)).json()["data"]}
    alpha = tenants["alpha"]
    quotas = {q["name"]: q for q in alpha["quotas"]}
    assert quotas["max_adapters"]["used"] == 2 and quotas["requests_per_minute"]["used"] >= 1
    (key,) = alpha["keys"]
    assert env.key_a.startswith(f"lmx_{key['prefix']}_") and key["last_used_at"] is not None
    assert set(key) == {"tenant_id", "prefix", "label", "is_admin", "created_at", "last_used_at",
                        "revoked_at"}
    row = _row((await client.get("/admin/adapters", headers=ADMIN)).json(), "a-only")
    assert row["requests_1m"] >= 1 and row["tokens_1m"] >= 4 and row["last_used"]
    assert sum(row["tokens_per_s"]) > 0 and row["in_flight"] == 0

    async def beta_rpm() -> int:
        data = (await client.get("/admin/tenants", headers=ADMIN)).json()["data"]
        quotas = next(t for t in data if t["name"] == "beta")["quotas"]
        return next(q for q in quotas if q["name"] == "requests_per_minute")["used"]

    before = await beta_rpm()
    r = await client.post("/v1/completions", headers=env.headers(env.key_b),
                          json={"model": BASE, "prompt": "x", "max_tokens": 2})
    assert r.status_code == 200 and await beta_rpm() == before + 1  # base-model requests count

    new_key = env.registry.create_api_key("beta", label="ci")
    assert env.registry.revoke_api_key(new_key)
    audit = (await client.get("/admin/events?tenant=beta", headers=ADMIN)).json()["data"]
    kinds = [e["kind"] for e in audit]
    assert "key_revoked" in kinds and "key_created" in kinds and "uploaded" in kinds
    assert all(e["tenant"] == "beta" for e in audit)


async def test_actions_fleet_and_engine(client, env):
    key = _row((await client.get("/admin/adapters", headers=ADMIN)).json(), "sql-lora")["key"]
    for action in ("warm", "pin", "unpin", "evict"):
        r = await client.post(f"/admin/adapters/{key}/{action}", headers=ADMIN)
        assert r.status_code == 200 and r.json()["done"] is True and r.json()["engines"] == ["local"]
    r = await client.post(f"/admin/adapters/{key}/pin?engine=local", headers=ADMIN)
    assert r.status_code == 200
    assert _row((await client.get("/admin/adapters", headers=ADMIN)).json(), "sql-lora")["pinned"]
    await client.post(f"/admin/adapters/{key}/unpin", headers=ADMIN)
    r = await client.post(f"/admin/adapters/{key}/warm?engine=gpu-7", headers=ADMIN)
    assert r.status_code == 404 and r.json()["error"]["code"] == "engine_not_found"
    kinds = [e["kind"] for e in (await client.get("/admin/events?tenant=alpha", headers=ADMIN)).json()["data"]]
    assert {"pinned", "unpinned", "evicted"} <= set(kinds)


async def test_deferred_eviction(client, env):
    key = _row((await client.get("/admin/adapters", headers=ADMIN)).json(), "b-only")["key"]
    assert (await client.post(f"/admin/adapters/{key}/warm", headers=ADMIN)).json()["done"]
    body = {"model": "b-only", "prompt": "long", "max_tokens": 200, "ignore_eos": True}
    task = asyncio.create_task(client.post("/v1/completions", headers=env.headers(env.key_b), json=body))
    for _ in range(500):
        row = _row((await client.get("/admin/adapters", headers=ADMIN)).json(), "b-only")
        if row["in_use"]:
            break
        await asyncio.sleep(0.01)
    assert row["in_use"] and row["in_flight"] == 1
    r = (await client.post(f"/admin/adapters/{key}/evict", headers=ADMIN)).json()
    assert r["done"] and r["deferred"] and "deferred" in r["detail"]
    row = _row((await client.get("/admin/adapters", headers=ADMIN)).json(), "b-only")
    assert row["evict_pending"] and row["tier"] == "device"
    assert (await task).status_code == 200
    for _ in range(200):
        row = _row((await client.get("/admin/adapters", headers=ADMIN)).json(), "b-only")
        if row["tier"] == "cpu":
            break
        await asyncio.sleep(0.01)
    assert row["tier"] == "cpu" and not row["evict_pending"] and row["in_flight"] == 0


async def test_recent_429s_per_tenant(env, tiny_model_dir):
    engine = make_engine(tiny_model_dir, max_model_len=256, max_num_seqs=1, max_waiting=1,
                         max_loras=1)
    app = create_app(settings(), engine=engine, registry=env.registry)
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://test", timeout=60) as c:
            body = {"model": BASE, "prompt": "x", "max_tokens": 60, "ignore_eos": True}
            rs = await asyncio.gather(*[
                c.post("/v1/completions", headers=env.headers(env.key_b), json=body)
                for _ in range(4)])
            assert 429 in [r.status_code for r in rs]
            tenants = (await c.get("/admin/tenants", headers=ADMIN)).json()["data"]
            beta = next(t for t in tenants if t["name"] == "beta")
            assert beta["rejections"] and beta["rejections"][0]["code"] == "queue_full"
            alpha = next(t for t in tenants if t["name"] == "alpha")
            assert alpha["rejections"] == []
    finally:
        close_state(app.services)
        engine.shutdown()
