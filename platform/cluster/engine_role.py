"""``--role engine``: today's server, reachable only through gateways, registered in Redis.

:func:`attach_engine_role` is called once the app's state is built (engine loaded). It
  * takes the caller from the gateway: the gateway authenticates the client's key and
    sends a signed identity (``Authorization: Bearer lmxgw.<tenant id>.<admin>.<mac>``,
    :func:`identity_token`), which :class:`GatewayIdentityAuthenticator` checks; client
    keys themselves are never accepted by an engine;
  * requires ``X-LoRAMux-Cluster-Secret`` on every route but ``/health``, ``/ready`` and
    ``/metrics`` (:class:`ClusterSecretMiddleware`, added by :func:`secure_app` before the
    app starts);
  * publishes a heartbeat: capacity, load, KV use, resident adapters per tier, the names
    it serves (:func:`engine_record`, from the engine's public residency snapshot), at
    once whenever the engine's adapter event hook reports a load, eviction or drop;
  * applies fanned-out admin actions (evict / pin / unpin / warm) and registry events
    (adapter deleted or replaced: drop its weights; key revoked: forget cached keys);
  * publishes the registry events of changes made through it (the adapter API), so every
    other engine and gateway hears of them.

A restarted engine starts with no adapters and resolves every adapter through the
registry on first use, so adapters deleted meanwhile are never served.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import hmac
import json
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from loramux.platform.auth import KEY_CACHE_TTL_S, Authenticator
from loramux.platform.cluster.state import (
    ActionReply,
    ClusterEvent,
    ClusterState,
    EngineHeartbeat,
    EngineRecord,
    EventSubscription,
)
from loramux.platform.dependencies import Dependencies
from loramux.platform.openai.resolver import Caller, engine_key
from loramux.platform.ttl_cache import TTLCache

if TYPE_CHECKING:
    from loramux.platform.state import AppState

logger = logging.getLogger(__name__)

SECRET_HEADER = "x-loramux-cluster-secret"
PREFIX_HEADER = "x-loramux-prefixes"
"""Comma-separated prompt-prefix hashes the gateway computed; the engine publishes the
recent ones so later requests sharing the prefix find the engine that cached it."""
OPEN_PATHS = ("/health", "/ready", "/metrics")
ADMIN_KINDS = ("evict", "pin", "unpin", "warm")


IDENTITY_PREFIX = "lmxgw."


def _mac(secret: str, payload: str) -> str:
    return hmac.new(secret.encode(), payload.encode(), hashlib.sha256).hexdigest()[:32]


def identity_token(secret: str, tenant_id: int | None, is_admin: bool) -> str:
    """The bearer token a gateway sends an engine for an authenticated caller."""
    payload = f"{'' if tenant_id is None else tenant_id}.{int(is_admin)}"
    return f"{IDENTITY_PREFIX}{payload}.{_mac(secret, payload)}"


class GatewayIdentityAuthenticator(Authenticator):
    """Engine role: the caller is whoever the gateway vouched for with :func:`identity_token`.
    Tenants are looked up by id (cached ``ttl`` seconds); anything else is no caller."""

    def __init__(self, registry, secret: str, *, allow_anonymous: bool,
                 ttl: float = KEY_CACHE_TTL_S, deps: Dependencies | None = None):
        super().__init__(registry, admin_key=None, allow_anonymous=allow_anonymous, ttl=ttl,
                         deps=deps)
        self.secret = secret
        self._tenants: TTLCache[int, object] = self.deps.stale_cache(ttl)

    async def lookup(self, key: str | None) -> Caller | None:
        if key is None or not key.startswith(IDENTITY_PREFIX):
            return None
        payload, _, mac = key[len(IDENTITY_PREFIX):].rpartition(".")
        if not hmac.compare_digest(mac, _mac(self.secret, payload)):
            return None
        tid, _, admin = payload.partition(".")
        if not tid:
            return Caller(None, is_admin=admin == "1")
        if self.registry is None:
            return None
        try:  # a database outage is the error table's 503, not "no caller"
            tenant = await self._tenants.aget_or_load(
                int(tid), lambda: self.deps.db.call(self.registry.get_tenant, int(tid)))
        except LookupError:  # a deleted tenant (TenantNotFound)
            return None
        return Caller(tenant, is_admin=admin == "1")

    def forget(self) -> None:
        super().forget()
        self._tenants.clear()


class RecentPrefixes:
    """The last ``size`` prefix hashes seen, newest last (thread-safe enough: one deque)."""

    def __init__(self, size: int = 512) -> None:
        self._hashes: collections.deque[str] = collections.deque(maxlen=size)

    def add(self, hashes: list[str]) -> None:
        for h in hashes:
            if h:
                self._hashes.append(h)

    def snapshot(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(reversed(self._hashes)))[::-1]


class ClusterSecretMiddleware:
    """Pure ASGI: 403 (OpenAI error shape) unless the request carries the cluster secret;
    records the gateway's prefix hashes of accepted requests into ``prefixes``."""

    def __init__(self, app, secret: str, prefixes: RecentPrefixes | None = None) -> None:
        self.app = app
        self.secret = secret.encode()
        self.prefixes = prefixes

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            headers = dict(scope["headers"])
            given = headers.get(SECRET_HEADER.encode(), b"")
            if hmac.compare_digest(given, self.secret) and self.prefixes is not None:
                raw = headers.get(PREFIX_HEADER.encode(), b"")
                if raw:
                    self.prefixes.add(raw.decode("latin-1").split(",")[:64])
            if not hmac.compare_digest(given, self.secret):
                body = json.dumps({"error": {
                    "message": "engines serve gateways only: missing or wrong cluster secret",
                    "type": "permission_error", "param": None, "code": "not_a_gateway"}}).encode()
                await send({"type": "http.response.start", "status": 403,
                            "headers": [(b"content-type", b"application/json"),
                                        (b"content-length", str(len(body)).encode())]})
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)


def secure_app(app, secret: str) -> RecentPrefixes:
    """Add the secret check (before the app starts serving); returns the prefix recorder."""
    prefixes = RecentPrefixes()
    app.add_middleware(ClusterSecretMiddleware, secret=secret, prefixes=prefixes)
    return prefixes


def engine_record(state: AppState, *, engine_id: str, url: str, started_at: float,
                  prefixes: tuple[str, ...] = ()) -> EngineRecord:
    """The heartbeat of one engine, read from its AppState (called from the heartbeat
    thread): load from ``AsyncEngine.stats``, residency from ``AsyncEngine.lora_snapshot``
    (taken on the engine thread)."""
    eng = state.engine
    stats = eng.stats()
    rows: list[dict] = []
    max_loras = 0
    if eng.is_ready:
        snap = asyncio.run(asyncio.wait_for(eng.lora_snapshot(), 5))
        rows, max_loras = snap.rows, snap.max_loras
    resident = tuple(sorted(r["name"] for r in rows if r["tier"] in ("gpu", "device")))
    cpu = tuple(sorted(r["name"] for r in rows if r["tier"] == "cpu"))
    static = tuple(state.resolver.static)
    return EngineRecord(
        engine_id, url=url, capacity=state.settings.max_num_seqs, max_loras=max_loras,
        running=stats.num_running, waiting=stats.num_waiting, kv_usage=stats.kv_cache_usage,
        resident=resident, cpu_resident=cpu, models=(*state.resolver.base_names, *static),
        static=static, prefixes=prefixes, started_at=started_at)


@dataclass
class EngineRole:
    """What :func:`attach_engine_role` started; :meth:`close` stops it and deregisters."""

    engine_id: str
    heartbeat: EngineHeartbeat
    events: EventSubscription

    def close(self) -> None:
        self.events.close()
        self.heartbeat.stop(engine_id=self.engine_id)


def attach_engine_role(state: AppState, cluster: ClusterState, *, engine_id: str, url: str,
                       interval: float,
                       prefixes: RecentPrefixes | None = None) -> EngineRole:
    """Register the engine and wire the fan-out (called once the app's state is built).
    Every subscription it makes is undone through ``state.cleanups``."""
    started = time.time()
    auth = state.auth  # a GatewayIdentityAuthenticator (build_authenticator, role engine)

    def on_event(ev: ClusterEvent) -> None:
        if ev.origin == engine_id:
            return
        if ev.kind in ADMIN_KINDS and ev.adapter_id:
            if ev.target not in (None, engine_id):
                return
            reply = ActionReply(engine_id, False)
            try:  # on the subscriber thread, with its own loop
                res = asyncio.run(asyncio.wait_for(state.admin.act(ev.adapter_id, ev.kind), 30))
                reply = ActionReply(engine_id, res.done, res.deferred)
            except Exception as e:
                logger.warning("cluster %s %s failed here: %s", ev.kind, ev.adapter_id, e)
                reply = ActionReply(engine_id, False, error=str(e) or type(e).__name__)
            if ev.reply_to:
                try:
                    cluster.push_reply(ev.reply_to, reply)
                except Exception as e:
                    logger.warning("could not answer %s %s: %s", ev.kind, ev.adapter_id, e)
        elif ev.kind in ("adapter_deleted", "adapter_replaced"):
            if ev.tenant_id is not None and ev.name is not None:
                state.resolver.invalidate(int(ev.tenant_id), ev.name)
            drop = state.resolver.drop_engine_key
            if ev.kind == "adapter_deleted" and ev.adapter_id and drop is not None:
                drop(ev.adapter_id)
        elif ev.kind == "key_revoked":
            auth.forget()

    if state.registry is not None:
        state.cleanups.append(state.registry.subscribe(
            lambda kind, handle: publish_registry_event(cluster, kind, handle, origin=engine_id)))
    events = cluster.subscribe(on_event, name=f"events-{engine_id}")
    recent = prefixes or RecentPrefixes()
    hb = EngineHeartbeat(cluster, lambda: engine_record(
        state, engine_id=engine_id, url=url, started_at=started, prefixes=recent.snapshot()),
        interval=interval)
    hb.start()
    # residency changes (load / evict / drop, on the engine thread) beat at once
    state.cleanups.append(state.engine.add_adapter_listener(lambda event, key: hb.wake()))
    role = EngineRole(engine_id, hb, events)
    state.cleanups.append(role.close)
    return role


def publish_registry_event(cluster: ClusterState, kind: str, handle, *, origin: str) -> None:
    """Relay a committed registry change (``deleted``/``replaced``, ``key_revoked``) to
    the cluster."""
    if kind == "key_revoked":
        ev = ClusterEvent("key_revoked", origin=origin)
    elif kind not in ("deleted", "replaced") or handle is None:
        return
    else:
        ev = ClusterEvent(f"adapter_{kind}",
                      adapter_id=engine_key(handle.tenant_id, handle.name, handle.cache_key),
                      tenant_id=str(handle.tenant_id), name=handle.name, origin=origin)
    try:
        cluster.publish_event(ev)
    except Exception as e:  # the change is committed; peers still expire their caches by TTL
        logger.warning("could not fan out %s of %s: %s", kind, handle.name, e)
