"""Errors by type: registry and store failures map through one table, and an unexpected
exception is a generic 500 in the OpenAI shape (no SQL, paths or bucket names; the
details go to the log). A revoked key is refused from the next request on."""

from __future__ import annotations

import logging

from loramux.registry.errors import ObjectStoreError


async def test_unexpected_error_is_generic_500(client, env, monkeypatch, caplog):
    secret = "SELECT * FROM adapters WHERE path='/var/lib/loramux/secret.db'"

    def boom(*_a, **_k):
        raise RuntimeError(secret)

    monkeypatch.setattr(env.registry, "list", boom)
    with caplog.at_level(logging.ERROR):
        r = await client.get("/v1/adapters", headers=env.headers(env.key_a))
    assert r.status_code == 500
    assert r.json() == {"error": {"message": "internal server error", "type": "server_error",
                                  "param": None, "code": None}}
    assert secret in caplog.text  # the operator still sees what happened


async def test_store_error_hides_the_bucket(client, env, monkeypatch):
    def unreachable(*_a, **_k):
        raise ObjectStoreError("s3://private-bucket-7/objects/ab: connection refused")

    monkeypatch.setattr(env.registry, "list", unreachable)
    r = await client.get("/v1/adapters", headers=env.headers(env.key_a))
    assert r.status_code == 503 and "private-bucket-7" not in r.text
    assert r.json()["error"]["type"] == "server_error"


async def test_revoked_key_is_refused_at_once(client, env):
    key = env.registry.create_api_key(env.tenant_a.id, label="short-lived")
    h = env.headers(key)
    assert (await client.get("/v1/adapters", headers=h)).status_code == 200  # now cached
    assert env.registry.revoke_api_key(key)
    r = await client.get("/v1/adapters", headers=h)
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert (await client.get("/v1/adapters", headers=env.headers(env.key_a))).status_code == 200
