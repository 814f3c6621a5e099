"""``--role engine``: today's server, reachable only through gateways, registered in Redis.

:func:`attach_engine_role` is called once the app's state is built (engine loaded). It
  * requires ``X-LoRAMux-Cluster-Secret`` on every route but ``/health``, ``/ready`` and
    ``/metrics`` (:class:`ClusterSecretMiddleware`, added by :func:`secure_app` before the
    app starts);
  * publishes a heartbeat: capacity, load, KV use, resident adapters per tier, the names
    it serves (:func:`engine_record`);
  * applies fanned-out admin actions (evict / pin / unpin / warm) and registry events
    (adapter deleted or replaced: drop its weights; key revoked: forget cached keys);
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
from dataclasses import dataclass

from loramux.platform.cluster.state import (
    ClusterEvent,
    ClusterState,
    EngineHeartbeat,
    EngineRecord,
    EventSubscription,
)

logger = logging.getLogger(__name__)

SECRET_HEADER = "x-loramux-cluster-secret"
OPEN_PATHS = ("/health", "/ready", "/metrics")
ADMIN_KINDS = ("evict", "pin", "unpin", "warm")


class ClusterSecretMiddleware:
    """Pure ASGI: 403 (OpenAI error shape) unless the request carries the cluster secret."""

    def __init__(self, app, secret: str) -> None:
        self.app = app
        self.secret = secret.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            given = dict(scope["headers"]).get(SECRET_HEADER.encode(), b"")
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


def secure_app(app, secret: str) -> None:
    """Add the secret check (before the app starts serving)."""
    app.add_middleware(ClusterSecretMiddleware, secret=secret)


def engine_record(state, *, engine_id: str, url: str, started_at: float) -> EngineRecord:
    """The heartbeat of one engine, read from its AppState (called from the heartbeat thread)."""
    eng = state.engine
    stats = eng.stats()
    mgr = eng.engine.lora_manager
    rows = eng.call_sync(mgr.residency, timeout=5) if (mgr is not None and eng.is_running) else []
    resident = tuple(sorted(r["name"] for r in rows if r["tier"] in ("gpu", "device")))
    cpu = tuple(sorted(r["name"] for r in rows if r["tier"] == "cpu"))
    static = tuple(state.resolver.static)
    sched = eng.engine.config.scheduler
    return EngineRecord(
        engine_id, url=url, capacity=sched.max_num_seqs,
        max_loras=mgr.max_loras if mgr is not None else 0,
        running=stats.num_running, waiting=stats.num_waiting, kv_usage=stats.kv_cache_usage,
        resident=resident, cpu_resident=cpu, models=(*state.resolver.base_names, *static),
        static=static, started_at=started_at)


@dataclass
class EngineRole:
    """What :func:`attach_engine_role` started; :meth:`close` stops it and deregisters."""

    engine_id: str
    heartbeat: EngineHeartbeat
    events: EventSubscription

    def close(self) -> None:
        self.events.close()
        self.heartbeat.stop(engine_id=self.engine_id)


def attach_engine_role(state, cluster: ClusterState, *, engine_id: str, url: str,
                       interval: float) -> EngineRole:
    """Register the engine and wire the fan-out (called once the app's state is built)."""
    started = time.time()

    def on_event(ev: ClusterEvent) -> None:
        if ev.origin == engine_id:
            return
        if ev.kind in ADMIN_KINDS and ev.adapter_id:
            try:  # on the subscriber thread, with its own loop
                asyncio.run(asyncio.wait_for(state.admin.act(ev.adapter_id, ev.kind), 30))
            except Exception as e:
                logger.warning("cluster %s %s failed here: %s", ev.kind, ev.adapter_id, e)
        elif ev.kind in ("adapter_deleted", "adapter_replaced"):
            if ev.tenant_id is not None and ev.name is not None:
                state.resolver.invalidate(int(ev.tenant_id), ev.name)
            mgr = state.engine.engine.lora_manager
            if ev.kind == "adapter_deleted" and ev.adapter_id and mgr is not None:
                state.engine.call_sync(lambda: mgr.drop(ev.adapter_id), timeout=30)
        elif ev.kind == "key_revoked":
            state.auth.forget()

    if state.registry is not None:
        state.registry.subscribe(
            lambda kind, handle: publish_registry_event(cluster, kind, handle, origin=engine_id))
    events = cluster.subscribe(on_event, name=f"events-{engine_id}")
    hb = EngineHeartbeat(cluster, lambda: engine_record(state, engine_id=engine_id, url=url,
                                                        started_at=started), interval=interval)
    hb.start()
    return EngineRole(engine_id, hb, events)


def publish_registry_event(cluster: ClusterState, kind: str, handle, *, origin: str) -> None:
    """Relay a committed registry change (``deleted``/``replaced``) to the cluster."""
    from loramux.platform.models import engine_key

    if kind not in ("deleted", "replaced"):
        return
    ev = ClusterEvent(f"adapter_{kind}",
                      adapter_id=engine_key(handle.tenant_id, handle.name, handle.cache_key),
                      tenant_id=str(handle.tenant_id), name=handle.name, origin=origin)
    try:
        cluster.publish_event(ev)
    except Exception as e:  # the change is committed; peers still expire their caches by TTL
        logger.warning("could not fan out %s of %s: %s", kind, handle.name, e)
