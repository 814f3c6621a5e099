"""Adapter releases through a live server (uvicorn on loopback, tiny model): a rollout
splits requests by weight and sticks per ``user``; ``name@N`` pins; a rollback moves new
requests at once while a stream started on the canary finishes on it; the official
``openai`` client sees the name it sent; bad input is a 4xx in the OpenAI shape and
changes nothing; another tenant sees none of it; retention removes old versions."""

from __future__ import annotations

import random
import threading
from collections import Counter
from types import SimpleNamespace

import httpx
import openai
import pytest
from support.adapters import write_random_adapter
from support.platform_settings import settings
from support.server import make_registry, parse_sse, serve_in_thread

from loramux.platform.app import create_app
from loramux.platform.identity import Caller
from loramux.platform.openai.resolver import ModelResolver
from loramux.platform.state import close_state
from loramux.registry.quotas import Quotas
from loramux.registry.rollouts import bucket

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def rel(engine, tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("releases")
    registry = make_registry(root / "registry", tiny_model_dir, max_lora_rank=16)
    acme, key = registry.create_tenant("acme")
    other, other_key = registry.create_tenant("other")
    dirs = [write_random_adapter(tiny_model_dir, root / f"v{i}", seed=40 + i, std=0.3)
            for i in range(4)]
    app = create_app(settings(), engine=engine, registry=registry)
    with serve_in_thread(app) as url:
        yield SimpleNamespace(url=url, app=app, registry=registry, acme=acme, key=key,
                              other=other, other_key=other_key, dirs=dirs)
    close_state(app.services)
    registry.db.dispose()


def _h(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _files(folder):
    return [("file", (n, (folder / n).read_bytes()))
            for n in ("adapter_config.json", "adapter_model.safetensors")]


def _upload(rel, name: str, folder, key: str | None = None) -> dict:
    r = httpx.post(f"{rel.url}/v1/adapters", headers=_h(key or rel.key), data={"name": name},
                   files=_files(folder), timeout=60)
    assert r.status_code == 201, r.text
    return r.json()


def _chat(rel, model: str, *, user: str | None = None, key: str | None = None, **kw):
    body = {"model": model, "max_tokens": 1, "temperature": 0,
            "messages": [{"role": "user", "content": "hi"}], **kw}
    if user is not None:
        body["user"] = user
    return httpx.post(f"{rel.url}/v1/chat/completions", headers=_h(key or rel.key), json=body,
                      timeout=60)


def _rollout(rel, name: str, key: str | None = None) -> dict:
    return httpx.get(f"{rel.url}/v1/adapters/{name}/rollout", headers=_h(key or rel.key),
                     timeout=30).json()


def _canary_user(salt: str, above: int) -> str:
    return next(u for u in (f"user-{i}" for i in range(10_000)) if bucket(salt, u) >= above)


async def test_a_thousand_seeded_users_split_90_10_and_stick(rel):
    """At the resolution level (no model run per request): the same code the server runs."""
    for d in rel.dirs[:2]:
        rel.registry.upload(rel.acme.id, "split-1k", d)
    rel.registry.set_rollout(rel.acme.id, "split-1k", {"1": 90, "2": 10})
    resolver = ModelResolver(["tiny"], registry=rel.registry, ttl=60)
    caller = Caller(rel.acme, key_prefix="0123456789ab")
    rng = random.Random(29)
    users = [f"end-user-{rng.getrandbits(48):x}" for _ in range(1000)]
    first = {u: (await resolver.resolve(caller, "split-1k", user=u)).version for u in users}
    counts = Counter(first.values())
    assert abs(counts[1] / 1000 - 0.90) <= 0.03 and abs(counts[2] / 1000 - 0.10) <= 0.03, counts
    again = {u: (await resolver.resolve(caller, "split-1k", user=u)).version for u in users}
    assert again == first  # one end user, one version
    # without a user every request is drawn by weight
    drawn = Counter([(await resolver.resolve(caller, "split-1k")).version for _ in range(1000)])
    assert abs(drawn[2] / 1000 - 0.10) <= 0.03, drawn
    # sticky per API key: one key, one version
    rel.registry.set_rollout(rel.acme.id, "split-1k", {"1": 50, "2": 50}, "key")
    resolver.invalidate(rel.acme.id, "split-1k")
    by_key = {(await resolver.resolve(caller, "split-1k", user=u)).version for u in users[:50]}
    assert len(by_key) == 1


@pytest.fixture(scope="module")
def split(rel):
    """``split``: two versions over HTTP, 70/30 sticky per user."""
    _upload(rel, "split", rel.dirs[0])
    _upload(rel, "split", rel.dirs[1])
    r = httpx.put(f"{rel.url}/v1/adapters/split/rollout", headers=_h(rel.key), timeout=30,
                  json={"weights": {"1": 70, "2": 30}, "sticky": "user"})
    assert r.status_code == 200 and r.json()["weights"] == {"1": 70, "2": 30}, r.text
    return "split"


def test_the_openai_client_sees_the_name_it_sent(rel, split):
    client = openai.OpenAI(base_url=f"{rel.url}/v1", api_key=rel.key, max_retries=0, timeout=60)
    salt = f"{rel.acme.id}/split"
    served = {}
    for i in range(24):
        user = f"person-{i}"
        raw = client.chat.completions.with_raw_response.create(
            model="split", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
            temperature=0, user=user)
        out = raw.parse()
        assert out.model == "split"
        served[user] = int(raw.headers["x-loramux-adapter-version"])
        assert served[user] == (1 if bucket(salt, user) < 70 else 2)  # the rollout's choice
    assert set(served.values()) == {1, 2}
    stream = client.chat.completions.create(
        model="split", messages=[{"role": "user", "content": "hi"}], max_tokens=3,
        temperature=0, user="person-0", stream=True)
    assert {chunk.model for chunk in stream} == {"split"}
    raw = client.completions.with_raw_response.create(model="split@2", prompt="hi", max_tokens=2)
    assert raw.parse().model == "split@2" and raw.headers["x-loramux-adapter-version"] == "2"
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="split@9", prompt="hi", max_tokens=2)
    assert e.value.body["code"] == "model_not_found" and "no version 9" in e.value.body["message"]
    # a gateway's pin (or a client's) by header; a bad one is 400
    r = httpx.post(f"{rel.url}/v1/completions", timeout=60,
                   headers={**_h(rel.key), "X-LoRAMux-Adapter-Version": "1"},
                   json={"model": "split", "prompt": "hi", "max_tokens": 1})
    assert r.status_code == 200 and r.headers["x-loramux-adapter-version"] == "1"
    r = httpx.post(f"{rel.url}/v1/completions", timeout=60,
                   headers={**_h(rel.key), "X-LoRAMux-Adapter-Version": "two"},
                   json={"model": "split", "prompt": "hi", "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "X-LoRAMux-Adapter-Version"


def test_rollback_moves_new_requests_while_a_canary_stream_finishes(rel):
    for d in rel.dirs[:2]:
        _upload(rel, "canary", d)
    r = httpx.put(f"{rel.url}/v1/adapters/canary/rollout", headers=_h(rel.key), timeout=30,
                  json={"weights": {"1": 90, "2": 10}})
    assert r.status_code == 200 and r.json()["rollback_to"] == 1
    user = _canary_user(f"{rel.acme.id}/canary", 90)
    assert _chat(rel, "canary", user=user).headers["x-loramux-adapter-version"] == "2"
    body = {"model": "canary", "user": user, "max_tokens": 120, "ignore_eos": True,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": "tell me"}]}
    got: dict = {}
    started = threading.Event()

    def stream() -> None:
        with httpx.stream("POST", f"{rel.url}/v1/chat/completions", headers=_h(rel.key),
                          json=body, timeout=120) as resp:
            got["version"] = resp.headers["x-loramux-adapter-version"]
            text = ""
            for chunk in resp.iter_text():
                text += chunk
                started.set()
            got["events"] = parse_sse(text)

    t = threading.Thread(target=stream)
    t.start()
    assert started.wait(60)
    r = httpx.post(f"{rel.url}/v1/adapters/canary/rollback", headers=_h(rel.key), timeout=30)
    assert r.status_code == 200 and r.json()["weights"] == {"1": 100}, r.text
    after = _chat(rel, "canary", user=user)
    assert after.headers["x-loramux-adapter-version"] == "1"  # at once
    t.join(120)
    events = got["events"]
    assert got["version"] == "2" and events[-1] == "[DONE]"
    assert {e["model"] for e in events[:-1]} == {"canary"}
    assert events[-2]["usage"]["completion_tokens"] == 120  # finished on the canary
    versions = httpx.get(f"{rel.url}/v1/adapters/canary/versions", headers=_h(rel.key),
                         timeout=30).json()
    by = {v["version"]: v for v in versions["data"]}
    assert by[1]["weight"] == 100 and by[2]["weight"] == 0
    assert by[2]["stats"]["requests"] == 2 and by[2]["stats"]["completion_tokens"] >= 121
    assert by[2]["stats"]["ttft_ms"]["p50"] is not None
    assert by[1]["stats"]["requests"] == 1 and versions["rollout"]["rollback_to"] == 2


@pytest.mark.parametrize("body, param", [
    ({"weights": {"1": 60, "2": 30}}, "weights"),
    ({"weights": {"1": 110, "2": -10}}, "weights.1"),
    ({"weights": {"1": 90.5, "2": 9.5}}, "weights.1"),
    ({"weights": {"1": 90.0, "2": 10}}, "weights.1"),
    ({"weights": {"1": True, "2": 99}}, "weights.1"),
    ({"weights": {"1": 50, "7": 50}}, "weights.7"),
    ({"weights": {"v1": 100}}, "weights.v1"),
    ({"weights": [1, 2]}, "weights"),
    ({"weights": {"1": 100}, "sticky": "cookie"}, "sticky"),
    ({"weights": {"1": 100}, "surprise": 1}, "surprise"),
    ({}, "weights"),
])
def test_bad_rollouts_are_400_and_change_nothing(rel, split, body, param):
    before = _rollout(rel, "split")
    r = httpx.put(f"{rel.url}/v1/adapters/split/rollout", headers=_h(rel.key), json=body,
                  timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["param"] == param
    assert err["type"] == "invalid_request_error"
    assert _rollout(rel, "split") == before


def test_versions_in_the_rollout_cannot_be_deleted(rel):
    for d in rel.dirs[:3]:
        _upload(rel, "deletable", d)
    h = _h(rel.key)
    r = httpx.put(f"{rel.url}/v1/adapters/deletable/rollout", headers=h, timeout=30,
                  json={"weights": {"2": 50, "3": 50}})
    assert r.status_code == 200
    r = httpx.delete(f"{rel.url}/v1/adapters/deletable/versions/3", headers=h, timeout=30)
    assert r.status_code == 409, r.text
    err = r.json()["error"]
    assert err["code"] == "version_in_rollout" and "2: 50%, 3: 50%" in err["message"]
    r = httpx.delete(f"{rel.url}/v1/adapters/deletable/versions/8", headers=h, timeout=30)
    assert r.status_code == 404 and r.json()["error"]["code"] == "version_not_found"
    r = httpx.delete(f"{rel.url}/v1/adapters/deletable/versions/1", headers=h, timeout=30)
    assert r.status_code == 200 and r.json() == {"id": "deletable@1", "object": "adapter.version",
                                                 "deleted": True}
    assert _chat(rel, "deletable@1").status_code == 404
    assert [v["version"] for v in httpx.get(f"{rel.url}/v1/adapters/deletable/versions",
                                            headers=h, timeout=30).json()["data"]] == [2, 3]
    r = httpx.get(f"{rel.url}/v1/adapters/deletable/versions/3", headers=h, timeout=30)
    assert r.status_code == 200 and r.json()["weight"] == 50 and r.json()["id"] == "deletable@3"


def test_retention_keeps_the_newest_versions(rel, tiny_model_dir, tmp_path):
    own = [write_random_adapter(tiny_model_dir, tmp_path / f"r{i}", seed=90 + i) for i in range(3)]
    rel.registry.set_quotas(rel.acme.id, Quotas(max_versions_per_adapter=2))
    try:
        handles = [_upload(rel, "retained", d) for d in own]
        data = httpx.get(f"{rel.url}/v1/adapters/retained/versions", headers=_h(rel.key),
                         timeout=30).json()["data"]
        assert [v["version"] for v in data] == [2, 3] and data[1]["weight"] == 100
        keys = {o.key for o in rel.registry.store.list("adapters/")}
        assert not any(handles[0]["sha256"] in k for k in keys)  # its weights are gone
        assert any(handles[1]["sha256"] in k for k in keys)
        assert _chat(rel, "retained@1").status_code == 404
        r = httpx.put(f"{rel.url}/v1/adapters/retained/rollout", headers=_h(rel.key),
                      json={"weights": {"2": 50, "3": 50}}, timeout=30)
        assert r.status_code == 200
        r = httpx.post(f"{rel.url}/v1/adapters", headers=_h(rel.key), data={"name": "retained"},
                       files=_files(rel.dirs[3]), timeout=60)
        assert r.status_code == 403 and r.json()["error"]["code"] == "quota_exceeded"
        assert r.json()["error"]["param"] == "max_versions_per_adapter"
        assert [v["version"] for v in httpx.get(
            f"{rel.url}/v1/adapters/retained/versions", headers=_h(rel.key),
            timeout=30).json()["data"]] == [2, 3]
    finally:
        rel.registry.set_quotas(rel.acme.id, None)


def test_another_tenant_sees_no_versions_rollouts_or_pins(rel, split):
    before = _rollout(rel, "split")
    h = _h(rel.other_key)
    calls = [
        ("GET", "/v1/adapters/split/versions", None),
        ("GET", "/v1/adapters/split/versions/1", None),
        ("DELETE", "/v1/adapters/split/versions/1", None),
        ("GET", "/v1/adapters/split/rollout", None),
        ("PUT", "/v1/adapters/split/rollout", {"weights": {"1": 100}}),
        ("DELETE", "/v1/adapters/split/rollout", None),
        ("POST", "/v1/adapters/split/rollback", None),
    ]
    for method, path, body in calls:
        r = httpx.request(method, f"{rel.url}{path}", headers=h, json=body, timeout=30)
        missing = httpx.request(method, f"{rel.url}{path.replace('split', 'nope')}", headers=h,
                                json=body, timeout=30)
        assert r.status_code == missing.status_code == 404, (path, r.text)
        assert r.json()["error"]["message"] == missing.json()["error"]["message"].replace(
            "nope", "split")
    for model in ("split", "split@1"):
        r = _chat(rel, model, key=rel.other_key)
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert _rollout(rel, "split") == before


def test_removing_a_version_keeps_the_engine_adapter_a_twin_version_shares(rel):
    from support.platform_settings import ADMIN_KEY

    _upload(rel, "twin", rel.dirs[2])
    _upload(rel, "twin", rel.dirs[2])  # the same bytes: one engine adapter for both
    assert _chat(rel, "twin@2").status_code == 200

    def keys():
        rows = httpx.get(f"{rel.url}/admin/adapters", timeout=30,
                         headers={"Authorization": f"Bearer {ADMIN_KEY}"}).json()["data"]
        return {r["key"] for r in rows if "/twin@" in r["key"] and r["tier"] != "store"}

    before = keys()
    assert len(before) == 1
    r = httpx.delete(f"{rel.url}/v1/adapters/twin/versions/1", headers=_h(rel.key), timeout=30)
    assert r.status_code == 200
    assert keys() == before  # not evicted: version 2 still uses it
    assert _chat(rel, "twin").headers["x-loramux-adapter-version"] == "2"
