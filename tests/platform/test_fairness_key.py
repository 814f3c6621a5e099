"""The platform passes the caller's tenant to the engine as the fairness key."""

from __future__ import annotations

from support.platform_settings import BASE


async def test_each_tenant_is_its_own_fairness_key(client, env):
    policy = env.engine.engine.scheduler.policy
    before = {k: policy.counters.get(k, 0.0) for k in (str(env.tenant_a.id), str(env.tenant_b.id))}
    body = {"model": BASE, "prompt": "count to three", "max_tokens": 3, "ignore_eos": True}
    r = await client.post("/v1/completions", headers=env.headers(env.key_a), json=body)
    assert r.status_code == 200, r.text
    assert policy.counters[str(env.tenant_a.id)] > before[str(env.tenant_a.id)]
    assert policy.counters.get(str(env.tenant_b.id), 0.0) == before[str(env.tenant_b.id)]
    r = await client.post("/v1/chat/completions", headers=env.headers(env.key_b), json={
        "model": BASE, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert policy.counters[str(env.tenant_b.id)] > before[str(env.tenant_b.id)]
