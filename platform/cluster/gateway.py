"""``--role gateway``: authenticates, applies the tenant's rate limits, resolves ``model``
through the registry, routes each request to an engine (:mod:`routing`) and proxies it.

* The tenant's quotas (``RegistryService.get_quotas``) are applied by a
  :class:`~loramux.platform.limits.tenant.TenantLimiter` over Redis (``--redis-url``), so
  every gateway charges the same buckets: over a limit is 429 with ``Retry-After`` from
  any gateway. The quota is held until the answer (or the stream) ends; a
  non-streaming answer's ``usage`` corrects the token estimate. With the limiter's Redis
  unreachable the gateway serves on without limits (and logs it), like its routing.

* A request that fails before its first byte reached the client (connection refused or
  reset, engine 502/503) is retried once on another engine; the client sees one answer.
* Streams pass through chunk by chunk. One that breaks after bytes were sent ends with an
  SSE error event (``code: engine_lost``), never a silent truncation.
* ``X-LoRAMux-Engine`` on every proxied response and the ``engine`` label of
  ``loramux_gateway_requests_total`` name the engine that served it.
* The admin dashboard and API (``/admin``) are served here over every engine
  (:mod:`.gateway_admin`): actions go to one engine (``?engine=``) or all through Redis,
  each engine answering; adapter-API calls are proxied to one engine (shared registry).
* ``/ready`` is 200 while any engine is live, with ``"status": "degraded"`` while Redis is
  unreachable (routing then runs on the last known view).

The routes are in :mod:`.gateway_app`; what is read from a request body in :mod:`.request_body`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import httpx
from fastapi import Request
from fastapi.responses import Response
from prometheus_client import CollectorRegistry, Counter, Gauge
from starlette.responses import StreamingResponse

from loramux.platform.auth import Authenticator, bearer_key
from loramux.platform.bulkheads import Dependencies
from loramux.platform.cluster.protocol import (
    ENGINE_HEADER,
    PREFIX_HEADER,
    SECRET_HEADER,
    ClusterEvent,
    identity_token,
)
from loramux.platform.cluster.redis_state import ClusterState
from loramux.platform.cluster.request_body import request_cost, usage_tokens
from loramux.platform.cluster.routing import AffinityRouter, NoEngineAvailable
from loramux.platform.cluster.schemas import GatewayReadiness
from loramux.platform.cluster.view import GatewayView
from loramux.platform.errors import ModelNotFound, ServiceUnavailable, Unauthorized
from loramux.platform.identity import Caller, EngineKey
from loramux.platform.limits.tenant import (
    LimiterUnavailable,
    QuotaHold,
    TenantLimiter,
)
from loramux.platform.openai.versions import VERSION_HEADER, choose_version, split_version
from loramux.platform.probes import probe
from loramux.platform.settings import setting_default
from loramux.platform.ttl_cache import TTLCache

if TYPE_CHECKING:
    from loramux.registry.handles import Release
    from loramux.registry.quotas import Quotas
    from loramux.registry.service import RegistryService

logger = logging.getLogger(__name__)

_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "host", "te",
        "trailer", "upgrade", "proxy-authorization", "proxy-authenticate", "content-encoding"}
_FORWARD = ("authorization", "content-type", "accept", "x-request-id", "openai-organization")
_RETRY_STATUS = (502, 503)


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("loramux_gateway_requests", "Proxied requests by serving engine",
                                ["engine", "route", "status"], registry=self.registry)
        self.retries = Counter("loramux_gateway_retries", "Requests retried on another engine",
                               registry=self.registry)
        self.broken_streams = Counter("loramux_gateway_broken_streams",
                                      "Streams ended with an error event", registry=self.registry)
        self.engines = Gauge("loramux_gateway_engines", "Live engines in the pool",
                             registry=self.registry)
        self.degraded = Gauge("loramux_gateway_redis_degraded",
                              "1 while Redis is unreachable (routing on the last view)",
                              registry=self.registry)


@dataclass
class Gateway:
    """One gateway's services; routes are thin wrappers around these methods."""

    registry: RegistryService | None
    auth: Authenticator
    cluster: ClusterState
    view: GatewayView
    router: AffinityRouter
    http: httpx.AsyncClient
    secret: str
    gateway_id: str
    resolve_ttl: float
    """Seconds a (tenant, adapter) release is cached (``model_cache_ttl``); a registry
    change reaches every gateway at once through the fan-out."""
    quota_ttl: float
    """Seconds a tenant's quotas are cached (``quota_cache_ttl``)."""
    max_request_bytes: int = setting_default("max_request_bytes")
    limiter: TenantLimiter | None = None
    """The tenant limiter (Redis backend: shared by every gateway); None = no limits."""
    metrics: GatewayMetrics = field(default_factory=GatewayMetrics)
    deps: Dependencies = field(default_factory=Dependencies)
    """The database bulkhead the registry reads run in (stale-on-error caches)."""

    def __post_init__(self) -> None:
        self._resolved: TTLCache[tuple[int, str], Release | None] = self.deps.stale_cache(
            self.resolve_ttl)
        self._quotas: TTLCache[int, Quotas] = self.deps.stale_cache(self.quota_ttl)
        self._activated: set[str] = set()  # engine keys of activated LoRA (aLoRA) versions

    # --- tenant limits ------------------------------------------------------------------
    async def quotas(self, tenant_id: int) -> Quotas:
        """The tenant's quotas in effect (cached ``quota_ttl`` seconds)."""
        return await self.deps.read_through(
            self._quotas, tenant_id, lambda: self.deps.db.call(self.registry.get_quotas, tenant_id))

    async def hold_quota(self, caller: Caller, body: dict,
                         stack: contextlib.AsyncExitStack) -> QuotaHold | None:
        """Hold the request's tenant quotas until ``stack`` closes;
        429 (with Retry-After) past a limit. None: nothing to limit, or the
        limiter's Redis is unreachable (served on, logged)."""
        if self.limiter is None or caller.tenant is None or self.registry is None:
            return None
        tenant_id = caller.tenant.id
        quotas = await self.quotas(tenant_id)
        try:
            return await stack.enter_async_context(
                self.limiter.hold(tenant_id, quotas, request_cost(body)))
        except LimiterUnavailable as e:
            logger.warning("gateway: tenant limits not applied (%s); serving on", e)
            return None

    # --- model resolution ---------------------------------------------------------------
    def _release(self, tenant_id: int, name: str) -> Release | None:
        from loramux.registry import AdapterNotFound, InvalidName

        try:
            return self.registry.resolve(tenant_id, name)
        except (AdapterNotFound, InvalidName):
            return None

    async def resolve(self, caller: Caller, name: str, *, user: str | None = None,
                      pinned: int | None = None) -> tuple[str | None, int | None]:
        """``(routing id, version)`` of ``model``: a tenant adapter version's engine key and
        number (``name@N`` or ``pinned``, else by the rollout, as an engine would choose),
        ``static/<name>``, or None for the base model; ModelNotFound when nothing serves it.
        The version goes to the engine pinned (:data:`VERSION_HEADER`), so the engine
        serves what was routed for, whatever its own cache says."""
        if caller.tenant is not None and self.registry is not None:
            tenant_id = caller.tenant.id
            adapter, number = split_version(name)
            release = await self.deps.read_through(
                self._resolved, (tenant_id, adapter),
                lambda: self.deps.db.call(self._release, tenant_id, adapter))
            if release is not None:
                version = choose_version(release, caller, user,
                                         number if number is not None else pinned)
                if version is None:
                    raise ModelNotFound(f"The model `{name}` does not exist: adapter `{adapter}` "
                                        f"has no version {number or pinned}.", param="model")
                handle = release.versions[version]
                key = str(EngineKey.for_handle(handle))
                if handle.kind == "aLoRA":
                    self._activated.add(key)
                return key, version
        for v in self.view.live():
            if name in v.static:
                return f"static/{name}", None
            if name in v.models:
                return None, None
        raise ModelNotFound(f"The model `{name}` does not exist.", param="model")

    def prefix_owner(self, adapter: str | None) -> str | None:
        """Whose prompt prefixes a request's routing hashes name: its adapter's, or the base
        model's for an activated LoRA (its context before the invocation is the base's KV
        on the engine, so it is routed to where that context is cached). After
        :meth:`resolve`."""
        return None if adapter in self._activated else adapter

    def on_event(self, ev: ClusterEvent) -> None:
        """Fan-out listener: forget cached releases and keys; drop evicted residency."""
        if ev.kind in ("adapter_deleted", "adapter_changed", "version_removed"):
            self.forget(int(ev.tenant_id) if ev.tenant_id is not None else None, ev.name)
        elif ev.kind == "key_revoked":
            self.auth.forget()
            self._quotas.clear()
        elif ev.kind == "evict" and ev.adapter_id:
            self.view.pool.note_evicted(ev.adapter_id)

    def forget(self, tenant_id: int | None, name: str | None) -> None:
        """Drop the cached release of one adapter (every one without both)."""
        if tenant_id is not None and name is not None:
            self._resolved.pop((tenant_id, name))
        else:
            self._resolved.clear()

    def resync(self) -> None:
        """Redis came back: the fan-out's events of the outage were missed, so every
        cached release and key is looked up again."""
        self.forget(None, None)
        self.auth.forget()
        self._quotas.clear()

    def on_registry_event(self, kind: str, handle) -> None:
        """The gateway's own registry changes (the dashboard's rollback): effective here
        at once (the fan-out tells the others)."""
        if handle is not None:
            self.forget(handle.tenant_id, handle.name)

    # --- proxying -----------------------------------------------------------------------
    def _headers(self, request: Request, caller: Caller | None) -> dict[str, str]:
        h = {k: v for k, v in request.headers.items()
             if k.lower() in _FORWARD and k.lower() != "authorization"}
        h[SECRET_HEADER] = self.secret
        if caller is not None:
            h["authorization"] = "Bearer " + identity_token(
                self.secret, caller.tenant_id, caller.is_admin, caller.key_prefix)
        return h

    async def optional_caller(self, request: Request) -> Caller | None:
        """The caller of a pass-through request: None without a key, 401 for a bad one."""
        header = request.headers.get("authorization")
        if bearer_key(header) is None:
            return None
        caller = await self.auth.lookup(bearer_key(header))
        if caller is None:
            raise Unauthorized("Incorrect API key provided.", headers={"WWW-Authenticate": "Bearer"})
        return caller

    async def forward(self, request: Request, body: bytes, *, caller: Caller | None,
                      adapter_id: str | None, prefixes: list[str] = (),
                      stream: bool = False, hold: QuotaHold | None = None,
                      done: Callable[[], Awaitable[object]] | None = None,
                      version: int | None = None) -> Response:
        """Send to the routed engine; retry once elsewhere if nothing reached the client.
        A relayed stream awaits ``done()`` when it ends (the caller's job otherwise);
        a JSON answer's usage is charged to ``hold``; ``version``: the adapter version
        chosen here, pinned for the engine."""
        tried: list[str] = []
        last = "no engine answered"
        for attempt in range(2):
            try:
                d = self.router.route(adapter_id, self.view.live(), prefixes=prefixes,
                                      exclude=tried, now=time.monotonic())
            except NoEngineAvailable:
                break
            eid = d.engine_id
            view = self.view.pool.get(eid)
            tried.append(eid)
            if attempt:
                self.metrics.retries.inc()
            url = view.url.rstrip("/") + request.url.path
            sent = self._headers(request, caller)
            if version is not None:
                sent[VERSION_HEADER] = str(version)
            if prefixes:
                sent[PREFIX_HEADER] = ",".join(prefixes)
            req = self.http.build_request(request.method, url, params=request.query_params,
                                          headers=sent, content=body)
            self.view.pool.started(eid)
            try:
                resp = await self.http.send(req, stream=True)
            except httpx.TransportError as e:
                self.view.pool.finished(eid)
                if isinstance(e, httpx.ConnectError | httpx.ConnectTimeout):
                    self.view.mark_failed(eid)
                last = f"engine {eid}: {type(e).__name__}: {e}"
                logger.warning("gateway: %s; retrying elsewhere", last)
                continue
            if resp.status_code in _RETRY_STATUS and attempt == 0:
                await resp.aclose()
                self.view.pool.finished(eid)
                last = f"engine {eid} answered {resp.status_code}"
                continue
            headers = {k: v for k, v in resp.headers.items() if k.lower() not in _HOP}
            headers[ENGINE_HEADER] = eid
            self.metrics.requests.labels(eid, d.reason, str(resp.status_code)).inc()
            if adapter_id is not None and resp.status_code == 200:
                self.view.pool.note_resident(eid, adapter_id)
            if stream and resp.headers.get("content-type", "").startswith("text/event-stream"):
                return StreamingResponse(self._relay(resp, eid, done), status_code=resp.status_code,
                                         headers=headers)
            try:
                content = await resp.aread()
            except httpx.TransportError as e:
                last = f"engine {eid} broke off: {e}"
                self.view.mark_failed(eid)
                continue
            finally:
                await resp.aclose()
                self.view.pool.finished(eid)
            if hold is not None and resp.status_code == 200:
                tokens = usage_tokens(content)
                if tokens is not None:
                    hold.charge(tokens)
            return Response(content, status_code=resp.status_code, headers=headers)
        raise ServiceUnavailable(f"no engine could serve the request ({last})",
                                 code="no_engine", headers={"Retry-After": "1"})

    async def _relay(self, resp: httpx.Response, eid: str,
                     done: Callable[[], Awaitable[object]] | None = None):
        tail = b""
        try:
            async for chunk in resp.aiter_raw():
                tail = (tail + chunk)[-32:]
                yield chunk
            if b"[DONE]" not in tail:
                raise httpx.RemoteProtocolError("stream ended before [DONE]")
        except httpx.TransportError as e:
            self.metrics.broken_streams.inc()
            logger.warning("gateway: stream from %s broke off: %s", eid, e)
            err = {"error": {"message": f"the engine serving this stream failed ({eid}); "
                             "the output above is incomplete", "type": "server_error",
                             "param": None, "code": "engine_lost"}}
            yield f"data: {json.dumps(err)}\n\n".encode()
        finally:
            await resp.aclose()
            self.view.pool.finished(eid)
            if done is not None:
                await done()

    def ready(self) -> tuple[int, GatewayReadiness]:
        live = self.view.live()
        self.metrics.engines.set(len(live))
        self.metrics.degraded.set(1 if self.view.degraded else 0)
        status = "degraded" if self.view.degraded else "ready"
        if not live:
            status = "no engines"
        body = GatewayReadiness(
            status=status, engines=[v.engine_id for v in live],
            redis="unreachable" if self.view.degraded else "ok",
            dependencies={"redis": "down" if self.view.degraded else "ok"})
        return (200 if live else 503), body

    async def probe_database(self, body: GatewayReadiness, timeout: float) -> None:
        """Add the registry database's state to a readiness body (a failing one makes a
        ready gateway ``degraded``: cached keys and routes still serve)."""
        if self.registry is None:
            return
        db, _ = await probe(self.deps.db, self.registry.db.ping, timeout)
        body.dependencies["database"] = db
        if db != "ok" and body.status == "ready":
            body.status = "degraded"
