"""Stored responses: the per-tenant caps (too large: answered, not stored; past the count or
bytes cap: the oldest evicted), a chain of ``previous_response_id`` past the context (the
chat path's 400), and a database outage (503 for ``previous_response_id``; a failed store
write still answers)."""

from __future__ import annotations

import json
import uuid

import httpx
import pytest
from sqlalchemy.exc import OperationalError
from support.platform_settings import BASE, settings

from loramux.platform.app import create_app
from loramux.platform.state import close_state
from loramux.registry.stored_responses import ResponseStoreLimits, stored_size

GREEDY = {"model": BASE, "temperature": 0, "max_output_tokens": 4}


def _down(*_a, **_k):
    raise OperationalError("SELECT 1", {}, Exception("connection to db-primary:5432 refused"))


@pytest.fixture
def tenant(env):
    t, key = env.registry.create_tenant(f"resp-{uuid.uuid4().hex[:8]}")
    return t, key


def _store(registry, tenant_id, rid, size_hint=10, **limits):
    body = {"id": rid, "pad": "x" * size_hint}
    return registry.store_response(tenant_id, rid, model="m", previous_response_id=None,
                                   body=body, conversation={"messages": []},
                                   limits=ResponseStoreLimits(**limits))


def test_registry_caps_evict_the_oldest_first(env, tenant):
    reg, (t, _) = env.registry, tenant
    for i in range(3):
        assert _store(reg, t.id, f"resp_c{i}", max_stored_responses=2).stored
    assert reg.get_stored_response(t.id, "resp_c0") is None
    assert [reg.get_stored_response(t.id, f"resp_c{i}") is not None for i in (1, 2)] == [True] * 2
    size = stored_size({"id": "resp_c1", "pad": "x" * 10}, {"messages": []})
    result = _store(reg, t.id, "resp_c3", max_stored_response_bytes_total=2 * size + 1)
    assert result.stored and result.evicted == ("resp_c1",)
    assert reg.stored_response_usage(t.id) == (2, 2 * size)
    too_big = _store(reg, t.id, "resp_big", size_hint=500, max_stored_response_bytes=200)
    assert not too_big.stored and "max_stored_response_bytes" in too_big.reason
    assert reg.get_stored_response(t.id, "resp_big") is None
    other = env.tenant_b.id  # another tenant sees nothing, deletes nothing
    assert reg.get_stored_response(other, "resp_c3") is None
    assert not reg.delete_stored_response(other, "resp_c3")
    assert reg.delete_stored_response(t.id, "resp_c3")
    assert reg.get_stored_response(t.id, "resp_c3") is None
    with pytest.raises(ValueError):
        ResponseStoreLimits(max_stored_responses=0)


async def _app_client(env, **kw):
    app = create_app(settings(**kw), engine=env.engine, registry=env.registry)
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test",
                               timeout=60)
    return app, client


async def test_store_caps_through_the_api(env, tenant):
    _, key = tenant
    headers = {"Authorization": f"Bearer {key}"}
    app, c = await _app_client(env, max_stored_responses=2, max_stored_response_bytes=4000)
    try:
        ids = []
        for i in range(3):
            r = await c.post("/v1/responses", headers=headers, json={"input": f"n{i}", **GREEDY})
            assert r.status_code == 200 and r.headers["x-loramux-stored"] == "true"
            ids.append(r.json()["id"])
        status = [(await c.get(f"/v1/responses/{i}", headers=headers)).status_code for i in ids]
        assert status == [404, 200, 200]  # the oldest was evicted
        big = {f"k{i}": "v" * 500 for i in range(10)}  # a body past 4000 bytes
        r = await c.post("/v1/responses", headers=headers,
                         json={"input": "y", "metadata": big, **GREEDY})
        assert r.status_code == 200 and r.json()["store"] is False
        assert r.headers["x-loramux-stored"] == "false"
        assert "max_stored_response_bytes" in r.headers["x-loramux-warnings"]
        assert (await c.get(f"/v1/responses/{r.json()['id']}", headers=headers)).status_code == 404
    finally:
        await c.aclose()
        close_state(app.services)


async def test_a_chain_past_the_context_is_the_chat_paths_400(client, env):
    """Each turn's prompt holds the whole chain: it grows until the chat path refuses it."""
    headers = env.headers(env.key_a)
    previous, sizes = None, []
    for _ in range(6):
        r = await client.post("/v1/responses", headers=headers, json={
            "input": "word " * 60, "previous_response_id": previous, **GREEDY})
        if r.status_code != 200:
            break
        sizes.append(r.json()["usage"]["input_tokens"])
        previous = r.json()["id"]
    assert r.status_code == 400, r.text
    assert len(sizes) >= 2 and sizes == sorted(sizes) and sizes[-1] <= 256
    err = r.json()["error"]
    assert err["code"] == "context_length_exceeded", err
    assert err["param"] in ("input", "max_output_tokens"), err


async def test_database_outage_is_503_for_previous_response_id(client, env, monkeypatch):
    headers = env.headers(env.key_a)
    first = (await client.post("/v1/responses", headers=headers,
                               json={"input": "hi", **GREEDY})).json()
    monkeypatch.setattr(env.registry, "get_stored_response", _down)
    for r in (await client.post("/v1/responses", headers=headers, json={
                  "input": "again", "previous_response_id": first["id"], **GREEDY}),
              await client.get(f"/v1/responses/{first['id']}", headers=headers)):
        assert r.status_code == 503, r.text
        assert r.json()["error"]["code"] == "database_unavailable"
        assert int(r.headers["retry-after"]) >= 1 and "db-primary" not in r.text


async def test_a_failed_store_write_still_answers(client, env, monkeypatch):
    headers = env.headers(env.key_a)
    monkeypatch.setattr(env.registry, "store_response", _down)
    r = await client.post("/v1/responses", headers=headers, json={"input": "hi", **GREEDY})
    assert r.status_code == 200 and r.json()["store"] is False and r.json()["output"]
    assert r.headers["x-loramux-stored"] == "false"
    assert "not stored" in r.headers["x-loramux-warnings"]
    r = await client.post("/v1/responses", headers=headers,
                          json={"input": "hi", "stream": True, **GREEDY})
    assert r.status_code == 200
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1]["type"] == "response.incomplete"
    assert events[-1]["response"]["store"] is False
