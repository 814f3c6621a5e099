"""Oversized lists are refused before they reach the engine: 400 naming the field, the
neighbour's latency unchanged."""

from __future__ import annotations

import httpx
import pytest

CASES = [
    ("stop", {"stop": [f"s{i}" for i in range(17)]}),
    ("stop", {"stop": ["x" * 257]}),
    ("stop_token_ids", {"stop_token_ids": list(range(257))}),
    ("allowed_token_ids", {"allowed_token_ids": list(range(4097))}),
    ("logit_bias", {"logit_bias": {str(i): 1.0 for i in range(301)}}),
    ("n", {"n": 64, "best_of": 64, "temperature": 1.0}),
]


@pytest.mark.latency
@pytest.mark.parametrize("param,extra", CASES, ids=[f"{p}-{i}" for i, (p, _) in enumerate(CASES)])
def test_oversized_request_names_the_field(live, tenants, param, extra):
    url, canary = live(max_request_work=1024)
    with canary.beside():
        for path, body in (("/v1/completions", {"prompt": "hi"}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
            r = httpx.post(f"{url}{path}", headers=tenants.auth(tenants.attacker_key), timeout=30,
                           json={"model": "attacker-lora", "max_tokens": 2, **body, **extra})
            assert r.status_code == 400, r.text
            assert r.json()["error"]["param"] == param, r.text


def test_caps_are_settings(live, tenants):
    url, _ = live(max_stop=2)
    h = tenants.auth(tenants.attacker_key)
    body = {"model": "attacker-lora", "prompt": "hi", "max_tokens": 2}
    assert httpx.post(f"{url}/v1/completions", headers=h, json={**body, "stop": ["a", "b"]},
                      timeout=30).status_code == 200
    r = httpx.post(f"{url}/v1/completions", headers=h, json={**body, "stop": ["a", "b", "c"]},
                   timeout=30)
    assert r.status_code == 400 and "max_stop" in r.json()["error"]["message"]
