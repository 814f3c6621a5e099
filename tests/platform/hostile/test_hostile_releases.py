"""Releases and usage under attack: a tenant with a large usage history hammers the usage
and version APIs with the widest grouping while flipping its rollout as fast as it can,
beside the neighbour's canary (latency and greedy output asserted). The attacker's costs
stay its own: bounded answers, the neighbour's latency and output unchanged, and none of
the attacker's records or versions visible to the neighbour."""

from __future__ import annotations

import concurrent.futures as cf
import time
from datetime import datetime, timedelta, timezone

import httpx
import pytest

NEIGHBOUR_BODY = {"model": "neighbour-lora", "prompt": "The capital of", "max_tokens": 6,
                  "temperature": 0}


def _history(tenant_id: int, n: int) -> list[dict]:
    now = datetime.now(timezone.utc)
    out = []
    for i in range(n):
        when = now - timedelta(minutes=i % 5000)
        out.append({"request_id": f"hist-{tenant_id}-{i}", "tenant_id": tenant_id,
                    "key_prefix": f"{i % 50:012d}", "adapter": f"a{i % 20}", "version": i % 5 + 1,
                    "endpoint": "chat", "prompt_tokens": 10, "cached_tokens": 0,
                    "completion_tokens": 5, "finish_reason": "stop", "error": None,
                    "duration_ms": 3.0, "ttft_ms": float(i % 97), "tpot_ms": 1.0,
                    "day": when.strftime("%Y-%m-%d"), "created_at": when})
    return out


@pytest.mark.latency
def test_usage_and_rollout_floods_leave_the_neighbour_alone(live, tenants):
    reg = tenants.registry
    history = _history(tenants.attacker.id, 30_000)
    for i in range(0, len(history), 5000):
        reg.usage.append(history[i:i + 5000])
    for d in tenants.adapter_dirs[:2]:
        reg.upload(tenants.attacker.id, "flip-lora", d)
    url, canary = live()
    before = httpx.post(f"{url}/v1/completions", json=NEIGHBOUR_BODY, timeout=30,
                        headers=tenants.auth(tenants.neighbour_key)).json()
    auth = tenants.auth(tenants.attacker_key)
    stop_at = time.monotonic() + 4.0
    answers: list[httpx.Response] = []

    def usage() -> None:
        with httpx.Client(base_url=url, headers=auth, timeout=30) as c:
            while time.monotonic() < stop_at:
                answers.append(c.get("/v1/usage", params={"group_by": "adapter,version,day,key",
                                                          "limit": 10000}))

    def flip() -> None:
        with httpx.Client(base_url=url, headers=auth, timeout=30) as c:
            i = 0
            while time.monotonic() < stop_at:
                w = i % 101
                answers.append(c.put("/v1/adapters/flip-lora/rollout",
                                     json={"weights": {"1": w, "2": 100 - w}}))
                answers.append(c.get("/v1/adapters/flip-lora/versions"))
                i += 1

    with canary.beside(), cf.ThreadPoolExecutor(3) as pool:
        for f in [pool.submit(usage), pool.submit(usage), pool.submit(flip)]:
            f.result(timeout=60)
    ok = [r for r in answers if r.status_code == 200]
    assert ok and all(r.status_code in (200, 503) for r in answers), {
        r.status_code for r in answers}
    big = next(r for r in ok if r.request.url.path == "/v1/usage").json()
    assert sum(r["requests"] for r in big["data"]) == 30_000 and not big["has_more"]
    page = httpx.get(f"{url}/v1/usage", headers=auth, timeout=30,
                     params={"group_by": "adapter,version,day,key", "limit": 50}).json()
    assert len(page["data"]) == 50 and page["has_more"] is True  # a bounded answer
    r = httpx.get(f"{url}/v1/usage", headers=auth, timeout=30, params={"limit": 10**6})
    assert r.status_code == 400 and r.json()["error"]["param"] == "limit"
    after = httpx.post(f"{url}/v1/completions", json=NEIGHBOUR_BODY, timeout=30,
                       headers=tenants.auth(tenants.neighbour_key)).json()
    assert after["choices"][0]["text"] == before["choices"][0]["text"]
    mine = httpx.get(f"{url}/v1/usage", params={"group_by": "adapter"}, timeout=30,
                     headers=tenants.auth(tenants.neighbour_key)).json()["data"]
    assert {r["adapter"] for r in mine} <= {"neighbour-lora"}
    assert httpx.get(f"{url}/v1/adapters/flip-lora/versions", timeout=30,
                     headers=tenants.auth(tenants.neighbour_key)).status_code == 404
