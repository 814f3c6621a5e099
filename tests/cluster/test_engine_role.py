"""The engine role's ASGI guard: only gateways (the cluster secret) get through; the
prefix hashes they send are remembered for the heartbeat."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.testclient import TestClient

from loramux.platform.cluster.engine_role import secure_app
from loramux.platform.cluster.heartbeat import RecentPrefixes
from loramux.platform.cluster.protocol import PREFIX_HEADER, SECRET_HEADER


def make_app():
    app = FastAPI()

    @app.post("/v1/completions")
    async def completions():
        return {"ok": True}

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    return app, secure_app(app, "s3cret")


def test_only_gateways_get_through_and_prefixes_are_recorded():
    app, prefixes = make_app()
    with TestClient(app) as client:
        r = client.post("/v1/completions", headers={PREFIX_HEADER: "p1,p2"})
        assert r.status_code == 403 and r.json()["error"]["code"] == "not_a_gateway"
        assert client.post("/v1/completions", headers={SECRET_HEADER: "wrong"}).status_code == 403
        assert prefixes.snapshot() == ()  # refused requests record nothing
        assert client.get("/health").status_code == 200  # probes need no secret
        r = client.post("/v1/completions", headers={SECRET_HEADER: "s3cret", PREFIX_HEADER: "p1,p2"})
        assert r.status_code == 200 and r.json() == {"ok": True}
        client.post("/v1/completions", headers={SECRET_HEADER: "s3cret", PREFIX_HEADER: "p3,p1"})
    assert prefixes.snapshot() == ("p2", "p3", "p1")


def test_recent_prefixes_are_bounded():
    rp = RecentPrefixes(size=3)
    rp.add(["a", "b", "c", "d", ""])
    assert rp.snapshot() == ("b", "c", "d")


class FakeRegistry:
    def __init__(self):
        self.calls = 0

    def get_tenant(self, tenant_id: int):
        from types import SimpleNamespace

        self.calls += 1
        if tenant_id != 7:
            raise LookupError("no such tenant")
        return SimpleNamespace(id=7, name="acme")


async def test_engines_take_the_caller_from_the_gateways_signed_identity():
    from loramux.platform.auth import GatewayIdentityAuthenticator
    from loramux.platform.cluster.protocol import identity_token

    reg = FakeRegistry()
    auth = GatewayIdentityAuthenticator(reg, "s3cret", allow_anonymous=False)
    caller = await auth.lookup(identity_token("s3cret", 7, False, "0123456789ab"))
    assert caller.tenant_id == 7 and not caller.is_admin and caller.key_prefix == "0123456789ab"
    await auth.lookup(identity_token("s3cret", 7, False))
    assert reg.calls == 1  # cached
    admin = await auth.lookup(identity_token("s3cret", None, True))
    assert admin.tenant is None and admin.is_admin
    # forged, tampered, another cluster's, a client key sent straight to the engine
    good = identity_token("s3cret", 7, False)
    assert await auth.lookup(identity_token("other", 7, True)) is None
    assert await auth.lookup(good.replace(".0.", ".1.")) is None
    assert await auth.lookup("lmx_live_clientkey") is None
    assert await auth.lookup(identity_token("s3cret", 8, False)) is None  # unknown tenant


def test_the_engine_role_builds_its_authenticator_once():
    """Role engine: the state is built with the identity authenticator (no swap that
    would leave a client-key authenticator subscribed to the registry)."""
    from loramux.platform.auth import Authenticator, GatewayIdentityAuthenticator
    from loramux.platform.builders import build_authenticator
    from loramux.platform.settings import Settings

    engine = build_authenticator(Settings(role="engine", cluster_secret="s3cret"), None)
    assert isinstance(engine, GatewayIdentityAuthenticator) and engine.secret == "s3cret"
    alone = build_authenticator(Settings(admin_key="k"), None)
    assert type(alone) is Authenticator


def test_identity_tokens_read_back():
    from loramux.platform.cluster.protocol import identity_token, read_identity

    assert read_identity("s", identity_token("s", 7, False)) == (7, False, None)
    assert read_identity("s", identity_token("s", None, True)) == (None, True, None)
    assert read_identity("s", identity_token("s", 7, False, "0123456789ab")) == (
        7, False, "0123456789ab")
    assert read_identity("other", identity_token("s", 7, True)) is None
    assert read_identity("s", None) is None and read_identity("s", "lmx_key") is None
