"""Tenant B can neither list, use, read, export nor delete tenant A's adapter, and every
attempt looks exactly like asking for an adapter that does not exist."""

from __future__ import annotations

from support.platform_settings import BASE

THEIRS = "sql-lora"  # tenant alpha's
MISSING = "zz-nothing"  # nobody's


def _masked(response, name: str) -> tuple[int, str]:
    return response.status_code, response.text.replace(name, "<NAME>")


async def _both(client, env, method: str, path: str, **kw):
    h = env.headers(env.key_b)
    a = await client.request(method, path.format(name=THEIRS), headers=h, **kw)
    b = await client.request(method, path.format(name=MISSING), headers=h, **kw)
    return a, b


async def test_b_cannot_see_or_touch_a_adapter(client, env):
    h_b = env.headers(env.key_b)
    models = (await client.get("/v1/models", headers=h_b)).json()["data"]
    assert THEIRS not in [m["id"] for m in models]
    listed = (await client.get("/v1/adapters", headers=h_b)).json()["data"]
    assert [a["id"] for a in listed] == ["b-only"]

    checks = [
        ("GET", "/v1/adapters/{name}", {}),
        ("PATCH", "/v1/adapters/{name}", {"json": {"preset": {"temperature": 1.0}}}),
        ("POST", "/v1/adapters/{name}/export", {}),
        ("DELETE", "/v1/adapters/{name}", {}),
        ("GET", "/v1/models/{name}", {}),
    ]
    for method, path, kw in checks:
        theirs, missing = await _both(client, env, method, path, **kw)
        assert theirs.status_code == 404, (method, path, theirs.text)
        assert _masked(theirs, THEIRS) == _masked(missing, MISSING), (method, path)

    for path, body in (
        ("/v1/completions", {"prompt": "x", "max_tokens": 2}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2}),
    ):
        for stream in (False, True):
            theirs = await client.post(path, json={**body, "model": THEIRS, "stream": stream}, headers=h_b)
            missing = await client.post(path, json={**body, "model": MISSING, "stream": stream}, headers=h_b)
            assert theirs.status_code == 404
            assert _masked(theirs, THEIRS) == _masked(missing, MISSING)

    # A's adapter is untouched and still works for A
    h_a = env.headers(env.key_a)
    got = await client.get(f"/v1/adapters/{THEIRS}", headers=h_a)
    assert got.status_code == 200 and got.json()["default_preset"]["temperature"] == 0.0
    r = await client.post("/v1/completions", json={"model": THEIRS, "prompt": "x", "max_tokens": 2},
                          headers=h_a)
    assert r.status_code == 200


async def test_same_name_in_two_tenants_are_different_adapters(client, env, adapter_dirs):
    h_b = env.headers(env.key_b)
    files = {
        "file": ("adapter_config.json", (adapter_dirs[2] / "adapter_config.json").read_bytes()),
        "file2": ("adapter_model.safetensors",
                  (adapter_dirs[2] / "adapter_model.safetensors").read_bytes()),
    }
    r = await client.post("/v1/adapters", data={"name": "shared-name"}, files=files, headers=h_b)
    assert r.status_code == 201, r.text
    files_a = {
        "file": ("adapter_config.json", (adapter_dirs[1] / "adapter_config.json").read_bytes()),
        "file2": ("adapter_model.safetensors",
                  (adapter_dirs[1] / "adapter_model.safetensors").read_bytes()),
    }
    r = await client.post("/v1/adapters", data={"name": "shared-name"}, files=files_a,
                          headers=env.headers(env.key_a))
    assert r.status_code == 201, r.text
    body = {"model": "shared-name", "prompt": "The quick brown fox", "max_tokens": 8, "temperature": 0}
    out_a = await client.post("/v1/completions", json=body, headers=env.headers(env.key_a))
    out_b = await client.post("/v1/completions", json=body, headers=h_b)
    direct_a = await client.post("/v1/completions", json={**body, "model": "a-only"},
                                 headers=env.headers(env.key_a))
    direct_b = await client.post("/v1/completions", json={**body, "model": "b-only"}, headers=h_b)
    assert out_a.json()["choices"][0]["text"] == direct_a.json()["choices"][0]["text"]
    assert out_b.json()["choices"][0]["text"] == direct_b.json()["choices"][0]["text"]
    assert out_a.json()["choices"][0]["text"] != out_b.json()["choices"][0]["text"]
    for key in (env.key_a, env.key_b):
        assert (await client.delete("/v1/adapters/shared-name", headers=env.headers(key))).status_code == 200
    assert BASE
