"""``--role engine``: today's server, reachable only through gateways, registered in Redis.

:func:`attach_engine_role` is called once the app's state is built (engine loaded). It
  * takes the caller from the gateway: the gateway authenticates the client's key and
    sends a signed identity (``Authorization: Bearer lmxgw.<tenant id>.<admin>.<mac>``,
    :func:`~.protocol.identity_token`), which :class:`GatewayIdentityAuthenticator` checks
    (``state.auth`` of an engine-role server, built by ``build_authenticator``); client
    keys themselves are never accepted by an engine;
  * requires ``X-LoRAMux-Cluster-Secret`` on every route but ``/health``, ``/ready`` and
    ``/metrics`` (:class:`ClusterSecretMiddleware`, added by :func:`secure_app` before the
    app starts);
  * publishes a heartbeat: capacity, load, KV use, resident adapters per tier, the names
    it serves (:func:`~.heartbeat.read_record`, from the engine's public residency snapshot), at
    once whenever the engine's adapter event hook reports a load, eviction or drop;
  * applies fanned-out admin actions (evict / pin / unpin / warm) and registry events
    (adapter deleted: drop every version's weights; a version removed: drop its weights;
    adapter changed (new version, rollout): forget its cached resolution; key revoked:
    forget cached keys);
  * publishes the registry events of changes made through it (the adapter API), so every
    other engine and gateway hears of them.

A restarted engine starts with no adapters and resolves every adapter through the
registry on first use, so adapters deleted meanwhile are never served.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from loramux.platform.admin.actions import ACTIONS
from loramux.platform.cluster.heartbeat import (
    EngineHeartbeat,
    HeartbeatSource,
    RecentPrefixes,
    read_record,
)
from loramux.platform.cluster.protocol import (
    OPEN_PATHS,
    PREFIX_HEADER,
    SECRET_HEADER,
    ActionReply,
    ClusterEvent,
)
from loramux.platform.identity import EngineKey

if TYPE_CHECKING:
    from loramux.platform.admin.service import AdminService
    from loramux.platform.auth import Authenticator
    from loramux.platform.cluster.redis_state import ClusterState, EventSubscription
    from loramux.registry.service import RegistryService

logger = logging.getLogger(__name__)


class EngineRoleState(HeartbeatSource, Protocol):
    """What the engine role reads and wires of a built server (an all-in-one app's state):
    the heartbeat's sources, the admin actions it applies, the caches it empties, and where
    its subscriptions are undone."""

    auth: Authenticator
    admin: AdminService
    registry: RegistryService | None
    cleanups: list[Callable[[], None]]



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


@dataclass
class EngineRole:
    """What :func:`attach_engine_role` started; :meth:`close` stops it and deregisters."""

    engine_id: str
    heartbeat: EngineHeartbeat
    events: EventSubscription

    def close(self) -> None:
        self.events.close()
        self.heartbeat.stop(engine_id=self.engine_id)


def attach_engine_role(state: EngineRoleState, cluster: ClusterState, *, engine_id: str, url: str,
                       interval: float,
                       prefixes: RecentPrefixes | None = None) -> EngineRole:
    """Register the engine and wire the fan-out (called once the app's state is built).
    Every subscription it makes is undone through ``state.cleanups``."""
    started = time.time()
    auth = state.auth  # a GatewayIdentityAuthenticator (build_authenticator, role engine)

    def on_event(ev: ClusterEvent) -> None:
        if ev.origin == engine_id:
            return
        if ev.kind in ACTIONS and ev.adapter_id:
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
        elif ev.kind in ("adapter_deleted", "adapter_changed", "version_removed"):
            if ev.tenant_id is None or ev.name is None:
                return
            tenant_id = int(ev.tenant_id)
            state.resolver.invalidate(tenant_id, ev.name)
            if ev.kind == "adapter_deleted":  # every version this engine served
                state.resolver.drop_adapter(tenant_id, ev.name,
                                            {ev.adapter_id} if ev.adapter_id else set())
            elif ev.kind == "version_removed" and ev.adapter_id:
                state.resolver.drop_version(tenant_id, ev.name, ev.adapter_id)
        elif ev.kind == "key_revoked":
            auth.forget()

    if state.registry is not None:
        state.cleanups.append(state.registry.subscribe(
            lambda kind, handle: publish_registry_event(cluster, kind, handle, origin=engine_id)))
    def resync() -> None:  # Redis came back: what the outage's events said was missed
        state.resolver.forget_all()
        auth.forget()

    events = cluster.subscribe(on_event, name=f"events-{engine_id}", on_resubscribe=resync)
    recent = prefixes or RecentPrefixes()
    hb = EngineHeartbeat(cluster, lambda: read_record(
        state, engine_id=engine_id, url=url, started_at=started, prefixes=recent.snapshot()),
        interval=interval)
    hb.start()
    # residency changes (load / evict / drop, on the engine thread) beat at once
    state.cleanups.append(state.engine.add_adapter_listener(lambda event, key: hb.wake()))
    role = EngineRole(engine_id, hb, events)
    state.cleanups.append(role.close)
    return role


REGISTRY_EVENTS = {"deleted": "adapter_deleted", "version_removed": "version_removed",
                   "uploaded": "adapter_changed", "version_added": "adapter_changed",
                   "rollout_changed": "adapter_changed", "rolled_back": "adapter_changed",
                   "preset_changed": "adapter_changed", "described": "adapter_changed",
                   "chat_changed": "adapter_changed"}
"""The registry's change kinds that every other gateway and engine must hear, as cluster
events."""


def publish_registry_event(cluster: ClusterState, kind: str, handle, *, origin: str) -> None:
    """Relay a committed registry change (:data:`REGISTRY_EVENTS`, ``key_revoked``) to
    the cluster."""
    if kind == "key_revoked":
        ev = ClusterEvent("key_revoked", origin=origin)
    elif kind not in REGISTRY_EVENTS or handle is None:
        return
    else:
        ev = ClusterEvent(REGISTRY_EVENTS[kind], adapter_id=str(EngineKey.for_handle(handle)),
                          tenant_id=str(handle.tenant_id), name=handle.name, origin=origin)
    try:
        cluster.publish_event(ev)
    except Exception as e:  # the change is committed; peers still expire their caches by TTL
        logger.warning("could not fan out %s of %s: %s", kind, ev.name or "-", e)
