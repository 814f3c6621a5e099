"""The dashboard's releases: every tenant adapter's versions, the live split and each
version's last-hour numbers (JSON and the Adapters view), and the rollback button's POST
(session + CSRF token; admin only), audited and effective for the next request."""

from __future__ import annotations

from support.adapters import write_random_adapter
from support.platform_settings import ADMIN_KEY

ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


async def _login(client) -> str:
    r = await client.post("/admin/login", data={"key": ADMIN_KEY})
    assert r.status_code == 303
    page = await client.get("/admin")
    return page.text.split('name="csrf-token" content="', 1)[1].split('"', 1)[0]


async def test_releases_view_and_rollback_button(client, env, tmp_path):
    reg = env.registry
    for i in range(2):
        reg.upload(env.tenant_a.id, "dash", write_random_adapter(
            env.model_dir, tmp_path / f"d{i}", seed=80 + i, std=0.3))
    reg.set_rollout(env.tenant_a.id, "dash", {"1": 80, "2": 20})
    h = env.headers(env.key_a)
    for model in ("dash@1", "dash@2", "dash@2"):
        r = await client.post("/v1/completions", headers=h,
                              json={"model": model, "prompt": "hi", "max_tokens": 3})
        assert r.status_code == 200, r.text
    assert (await client.get("/admin/releases", headers=h)).status_code == 403
    body = (await client.get("/admin/releases", headers=ADMIN)).json()
    (row,) = [r for r in body["data"] if r["adapter"] == "dash"]
    assert row["tenant"] == "alpha" and row["split"] == "v1 80% · v2 20%"
    assert row["rollback_to"] == 1
    versions = {v["version"]: v for v in row["versions"]}
    assert versions[1]["requests"] == 1 and versions[2]["requests"] == 2
    assert versions[2]["completion_tokens"] == 6 and versions[2]["ttft_p50_ms"] is not None

    token = await _login(client)
    page = (await client.get("/admin/ui/adapters")).text
    html = page.split('data-release="alpha/dash"', 1)[1].split("</table></td>", 1)[1]
    assert 'data-rollback="dash"' in html and "rollback to v1" in html
    assert "v1 80% · v2 20%" in page
    r = await client.post("/admin/releases/alpha/dash/rollback")  # no CSRF token
    assert r.status_code == 403 and r.json()["error"]["code"] == "csrf_failed"
    assert reg.release(env.tenant_a.id, "dash").rollout.weights == ((1, 80), (2, 20))
    r = await client.post("/admin/releases/alpha/dash/rollback", headers={"X-CSRF-Token": token})
    assert r.status_code == 200 and r.json()["split"] == "v1 100%", r.text
    r = await client.post("/v1/completions", headers=h,
                          json={"model": "dash", "prompt": "hi", "max_tokens": 1, "user": "u"})
    assert r.headers["x-loramux-adapter-version"] == "1"
    [event] = [e for e in reg.events(env.tenant_a.id, adapter_name="dash")
               if e.kind == "rolled_back"]
    assert event.actor == "admin" and event.details["to"]["weights"] == {"1": 100}
    r = await client.post("/admin/releases/nobody/dash/rollback", headers={"X-CSRF-Token": token})
    assert r.status_code == 404 and r.json()["error"]["code"] == "tenant_not_found"
    r = await client.post("/admin/releases/beta/dash/rollback", headers={"X-CSRF-Token": token})
    assert r.status_code == 404  # beta has no such adapter
    reg.delete(env.tenant_a.id, "dash")


async def test_a_tenant_key_cannot_roll_back_through_the_admin_api(client, env):
    r = await client.post("/admin/releases/alpha/sql-lora/rollback", headers=env.headers(env.key_a))
    assert r.status_code == 403
    assert (await client.post("/admin/releases/alpha/sql-lora/rollback")).status_code == 401
