"""A tenant over its quota gets 429 with ``Retry-After`` in the OpenAI shape, from both
limiter backends (in-process, and Redis against the real server), while the neighbour
keeps its latency; a request that alone is past a quota gets 400 (retrying won't help)."""

from __future__ import annotations

import time

import httpx
import pytest

from loramux.registry.quotas import Quotas

BODY = {"model": "attacker-lora", "prompt": "hi", "max_tokens": 2}


@pytest.fixture(params=["memory", "redis"])
def backend(request, tenants):
    """Settings for one limiter backend; the attacker's quotas and Redis keys are reset."""
    overrides = {}
    if request.param == "redis":
        import redis

        url = request.getfixturevalue("redis_url")
        client = redis.Redis.from_url(url)
        pattern = f"loramux:limits:{{{tenants.attacker.id}}}:*"

        def clear():
            for key in client.scan_iter(match=pattern):
                client.delete(key)

        clear()
        request.addfinalizer(clear)
        request.addfinalizer(client.close)
        overrides["redis_url"] = url
    request.addfinalizer(lambda: tenants.registry.set_quotas(tenants.attacker.id, None))
    return overrides


@pytest.mark.latency
def test_rate_limited_tenant_gets_429_with_retry_after(live, tenants, backend):
    url, canary = live(**backend)
    h = tenants.auth(tenants.attacker_key)
    tenants.registry.set_quotas(tenants.attacker.id, Quotas(requests_per_minute=3))
    with canary.beside():
        codes = [httpx.post(f"{url}/v1/completions", headers=h, json=BODY, timeout=30)
                 for _ in range(5)]
    assert [r.status_code for r in codes[:3]] == [200, 200, 200], [r.text for r in codes]
    for r in codes[3:]:
        assert r.status_code == 429, r.text
        assert int(r.headers["Retry-After"]) >= 1
        err = r.json()["error"]
        assert err["type"] == err["code"] == "rate_limit_exceeded"
        assert err["param"] == "requests_per_minute"
    # the quota is the attacker's alone
    r = httpx.post(f"{url}/v1/completions", headers=tenants.auth(tenants.neighbour_key),
                   json={**BODY, "model": "neighbour-lora"}, timeout=30)
    assert r.status_code == 200, r.text


def test_request_past_a_quota_alone_is_400(live, tenants, backend):
    url, _ = live(**backend)
    tenants.registry.set_quotas(tenants.attacker.id, Quotas(max_queued_sequences=2))
    r = httpx.post(f"{url}/v1/completions", headers=tenants.auth(tenants.attacker_key),
                   json={**BODY, "n": 3, "temperature": 1.0}, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "request_too_large" and "retrying will not help" in err["message"]


def test_quotas_api_shows_quotas_and_usage(live, tenants, backend):
    url, _ = live(**backend)
    tenants.registry.set_quotas(tenants.attacker.id, Quotas(tokens_per_minute=1000, max_adapters=3))
    r = httpx.get(f"{url}/v1/quotas", headers=tenants.auth(tenants.attacker_key), timeout=30)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tenant"] == "attacker"
    assert body["quotas"]["tokens_per_minute"] == 1000 and body["quotas"]["max_adapters"] == 3
    assert body["quotas"]["requests_per_minute"] is None
    assert body["usage"]["adapters"] == 1 and body["usage"]["stored_bytes"] > 0
    assert httpx.get(f"{url}/v1/quotas", timeout=30).status_code == 401


@pytest.mark.latency
def test_a_stream_holds_its_concurrency_slot_until_it_ends(live, tenants, backend):
    url, canary = live(**backend)
    h = tenants.auth(tenants.attacker_key)
    tenants.registry.set_quotas(tenants.attacker.id, Quotas(max_concurrent_requests=1))
    body = {**BODY, "max_tokens": 200, "ignore_eos": True, "stream": True}
    with canary.beside(), httpx.stream("POST", f"{url}/v1/completions", headers=h, json=body,
                                       timeout=30) as stream:
        assert stream.status_code == 200
        lines = stream.iter_lines()  # keep it: dropping it closes the connection
        next(lines)  # the stream has started: its slot is held
        r = httpx.post(f"{url}/v1/completions", headers=h, json=BODY, timeout=30)
        assert r.status_code == 429 and r.json()["error"]["param"] == "max_concurrent_requests"
        assert int(r.headers["Retry-After"]) >= 1
        assert "data: [DONE]" in "\n".join(lines)
    for _ in range(50):  # released when the stream ended (the handler's finally)
        r = httpx.post(f"{url}/v1/completions", headers=h, json=BODY, timeout=30)
        if r.status_code == 200:
            break
        time.sleep(0.05)
    assert r.status_code == 200, r.text


def test_a_quota_change_takes_effect_at_once(live, tenants, backend):
    url, _ = live(**backend)  # quotas are cached for quota_cache_ttl (5 s) …
    h = tenants.auth(tenants.attacker_key)
    assert httpx.post(f"{url}/v1/completions", headers=h, json=BODY, timeout=30).status_code == 200
    tenants.registry.set_quotas(tenants.attacker.id, Quotas(requests_per_minute=1))
    codes = [httpx.post(f"{url}/v1/completions", headers=h, json=BODY, timeout=30).status_code
             for _ in range(2)]  # … but a change drops the cache
    assert codes == [200, 429]


def test_unreachable_redis_is_503_without_its_address(live, tenants):
    from support.server import free_port

    url, _ = live(redis_url=f"redis://127.0.0.1:{free_port()}/0")
    tenants.registry.set_quotas(tenants.attacker.id, Quotas(requests_per_minute=100))
    try:
        r = httpx.post(f"{url}/v1/completions", headers=tenants.auth(tenants.attacker_key),
                       json=BODY, timeout=30)
    finally:
        tenants.registry.set_quotas(tenants.attacker.id, None)
    assert r.status_code == 503 and r.json()["error"]["code"] == "limiter_unavailable", r.text
    assert "127.0.0.1" not in r.text and "redis" not in r.text.lower()


def test_storage_quota_refuses_an_upload_with_403(live, tenants):
    url, _ = live()
    folder = tenants.adapter_dirs[2]
    files = [("file", (name, (folder / name).read_bytes()))
             for name in ("adapter_config.json", "adapter_model.safetensors")]
    tenants.registry.set_quotas(tenants.attacker.id, Quotas(max_adapters=1))
    try:
        r = httpx.post(f"{url}/v1/adapters", headers=tenants.auth(tenants.attacker_key),
                       data={"name": "one-too-many"}, files=files, timeout=30)
    finally:
        tenants.registry.set_quotas(tenants.attacker.id, None)
    assert r.status_code == 403, r.text
    err = r.json()["error"]
    assert err["code"] == "quota_exceeded" and err["param"] == "max_adapters"
    assert "/" not in err["message"]  # no paths
