"""Loose ends: ``/metrics`` (it names every tenant's adapters) needs the admin key unless
the operator opts out; a revoked key is refused on the very next request; adapter names
in the HTTP path must match in full."""

from __future__ import annotations

import httpx
import pytest
from support.platform_settings import ADMIN_KEY


@pytest.mark.latency
def test_metrics_needs_the_admin_key(live, tenants):
    url, canary = live()
    with canary.beside():
        assert httpx.get(f"{url}/metrics", timeout=30).status_code == 401
        r = httpx.get(f"{url}/metrics", headers=tenants.auth(tenants.attacker_key), timeout=30)
        assert r.status_code == 403 and "neighbour" not in r.text  # a tenant key is no admin key
        r = httpx.get(f"{url}/metrics", headers=tenants.auth(ADMIN_KEY), timeout=30)
        assert r.status_code == 200 and "loramux_" in r.text


def test_metrics_public_when_the_operator_says_so(live):
    url, _ = live(metrics_public=True)
    assert httpx.get(f"{url}/metrics", timeout=30).status_code == 200


@pytest.mark.latency
def test_revoked_key_refused_on_the_next_request(live, tenants):
    url, canary = live()
    key = tenants.registry.create_api_key(tenants.attacker.id)
    h = tenants.auth(key)
    body = {"model": "attacker-lora", "prompt": "hi", "max_tokens": 2}
    assert httpx.post(f"{url}/v1/completions", headers=h, json=body, timeout=30).status_code == 200
    assert tenants.registry.revoke_api_key(key)
    r = httpx.post(f"{url}/v1/completions", headers=h, json=body, timeout=30)
    assert r.status_code == 401, r.text
    canary.check()


def test_adapter_name_with_trailing_newline_is_not_found(live, tenants):
    url, _ = live()
    h = tenants.auth(tenants.attacker_key)
    r = httpx.get(f"{url}/v1/adapters/attacker-lora%0A", headers=h, timeout=30)
    assert r.status_code in (400, 404), r.text
    assert httpx.get(f"{url}/v1/adapters/attacker-lora", headers=h, timeout=30).status_code == 200
    r = httpx.post(f"{url}/v1/completions", headers=h, timeout=30,
                   json={"model": "attacker-lora\n", "prompt": "hi", "max_tokens": 2})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", r.text
