"""``--role gateway``: authenticates, resolves ``model`` through the registry, routes each
request to an engine (:mod:`routing`) and proxies it.

* A request that fails before its first byte reached the client (connection refused or
  reset, engine 502/503) is retried once on another engine; the client sees one answer.
* Streams pass through chunk by chunk. One that breaks after bytes were sent ends with an
  SSE error event (``code: engine_lost``), never a silent truncation.
* ``X-LoRAMux-Engine`` on every proxied response and the ``engine`` label of
  ``loramux_gateway_requests_total`` name the engine that served it.
* ``POST /admin/adapters/{key}/{evict|pin|unpin|warm}`` fans out to every engine through
  Redis; other admin and adapter-API calls are proxied to one engine (they share the registry).
* ``/ready`` is 200 while any engine is live, with ``"status": "degraded"`` while Redis is
  unreachable (routing then runs on the last known view).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    generate_latest,
)
from starlette.concurrency import run_in_threadpool
from starlette.responses import StreamingResponse

from loramux.platform.auth import Authenticator, bearer_key
from loramux.platform.cluster.engine_role import (
    ADMIN_KINDS,
    PREFIX_HEADER,
    SECRET_HEADER,
    identity_token,
)
from loramux.platform.cluster.routing import AffinityRouter, NoEngineAvailable, prefix_hashes
from loramux.platform.cluster.state import ClusterEvent, ClusterState, GatewayView
from loramux.platform.errors import (
    BadRequest,
    ModelNotFound,
    PayloadTooLarge,
    ServiceUnavailable,
    Unauthorized,
    install_error_handlers,
)
from loramux.platform.models import Caller, engine_key

logger = logging.getLogger(__name__)

ENGINE_HEADER = "X-LoRAMux-Engine"
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


def prompt_text(body: dict) -> str:
    """The text the prefix hashes are computed over: the prompt, or the messages' contents."""
    if isinstance(body.get("prompt"), str):
        return body["prompt"]
    parts = []
    for m in body.get("messages") or ():
        if isinstance(m, dict):
            c = m.get("content")
            parts.append(c if isinstance(c, str) else json.dumps(c, sort_keys=True))
    return "\n".join(parts)


@dataclass
class Gateway:
    """One gateway's services; routes are thin wrappers around these methods."""

    registry: Any | None
    auth: Authenticator
    cluster: ClusterState
    view: GatewayView
    router: AffinityRouter
    http: httpx.AsyncClient
    secret: str
    gateway_id: str
    resolve_ttl: float = 5.0
    max_request_bytes: int = 8 * 1024 * 1024
    metrics: GatewayMetrics = field(default_factory=GatewayMetrics)
    _resolved: dict[tuple[int, str], tuple[float, str | None]] = field(default_factory=dict)

    # --- model resolution ---------------------------------------------------------------
    def _registry_key(self, tenant_id: int, name: str) -> str | None:
        from loramux.registry import AdapterNotFound, InvalidName

        try:
            h = self.registry.resolve(tenant_id, name)
        except (AdapterNotFound, InvalidName):
            return None
        return engine_key(h.tenant_id, h.name, h.cache_key)

    async def resolve(self, caller: Caller, name: str) -> str | None:
        """The routing id of ``model``: a tenant adapter's engine key, ``static/<name>``,
        or None for the base model; ModelNotFound when no live engine serves it."""
        if caller.tenant is not None and self.registry is not None:
            k = (caller.tenant.id, name)
            hit = self._resolved.get(k)
            if hit is not None and time.monotonic() - hit[0] < self.resolve_ttl:
                key = hit[1]
            else:
                key = await run_in_threadpool(self._registry_key, caller.tenant.id, name)
                self._resolved[k] = (time.monotonic(), key)
            if key is not None:
                return key
        for v in self.view.live():
            models, static = self.view.models.get(v.engine_id, ((), ()))
            if name in static:
                return f"static/{name}"
            if name in models:
                return None
        raise ModelNotFound(f"The model `{name}` does not exist.", param="model")

    def on_event(self, ev: ClusterEvent) -> None:
        """Fan-out listener: forget cached resolutions and keys; drop evicted residency."""
        if ev.kind in ("adapter_deleted", "adapter_replaced"):
            if ev.tenant_id is not None and ev.name is not None:
                self._resolved.pop((int(ev.tenant_id), ev.name), None)
            else:
                self._resolved.clear()
        elif ev.kind == "key_revoked":
            self.auth.forget()
        elif ev.kind == "evict" and ev.adapter_id:
            self.view.pool.note_evicted(ev.adapter_id)

    # --- proxying -----------------------------------------------------------------------
    def _headers(self, request: Request, caller: Caller | None) -> dict[str, str]:
        h = {k: v for k, v in request.headers.items()
             if k.lower() in _FORWARD and k.lower() != "authorization"}
        h[SECRET_HEADER] = self.secret
        if caller is not None:
            h["authorization"] = "Bearer " + identity_token(self.secret, caller.tenant_id,
                                                            caller.is_admin)
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
                      stream: bool = False) -> Response:
        """Send to the routed engine; retry once elsewhere if nothing reached the client."""
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
                return StreamingResponse(self._relay(resp, eid), status_code=resp.status_code,
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
            return Response(content, status_code=resp.status_code, headers=headers)
        raise ServiceUnavailable(f"no engine could serve the request ({last})",
                                 code="no_engine", headers={"Retry-After": "1"})

    async def _relay(self, resp: httpx.Response, eid: str):
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

    async def fan_out(self, key: str, action: str) -> dict:
        ev = ClusterEvent(action, adapter_id=key, origin=self.gateway_id)
        try:
            n = await run_in_threadpool(self.cluster.publish_event, ev)
        except Exception as e:
            raise ServiceUnavailable(f"cannot reach Redis to fan out {action}: {e}") from None
        self.on_event(ev)
        return {"key": key, "action": action, "fanned_out": True, "receivers": n}

    def ready(self) -> tuple[int, dict]:
        live = self.view.live()
        self.metrics.engines.set(len(live))
        self.metrics.degraded.set(1 if self.view.degraded else 0)
        status = "degraded" if self.view.degraded else "ready"
        if not live:
            status = "no engines"
        body = {"status": status, "engines": [v.engine_id for v in live],
                "redis": "unreachable: " + self.view.last_error if self.view.degraded else "ok"}
        return (200 if live else 503), body


def create_gateway_app(gw: Gateway, *, on_shutdown=()) -> FastAPI:
    """The gateway's HTTP app around a built :class:`Gateway`."""
    import contextlib

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        try:
            yield
        finally:
            for fn in on_shutdown:
                with contextlib.suppress(Exception):
                    fn()
            await gw.http.aclose()

    app = FastAPI(title="loramux gateway", lifespan=lifespan)
    install_error_handlers(app)
    app.state.gateway = gw

    async def read_body(request: Request) -> bytes:
        body = await request.body()
        if len(body) > gw.max_request_bytes and not request.url.path.startswith("/v1/adapters"):
            raise PayloadTooLarge(f"request body over {gw.max_request_bytes} bytes")
        return body

    async def inference(request: Request) -> Response:
        body = await read_body(request)
        try:
            parsed = json.loads(body)
        except ValueError:
            raise BadRequest("the body is not valid JSON") from None
        if not isinstance(parsed, dict) or not isinstance(parsed.get("model"), str):
            raise BadRequest("`model` is required", param="model")
        caller = await gw.auth.caller(request.headers.get("authorization"))
        adapter = await gw.resolve(caller, parsed["model"])
        cfg = gw.router.config
        prefixes = prefix_hashes(adapter, prompt_text(parsed), chunk_chars=cfg.prefix_chunk_chars,
                                 max_chunks=cfg.max_prefix_chunks)
        return await gw.forward(request, body, caller=caller, adapter_id=adapter, prefixes=prefixes,
                                stream=bool(parsed.get("stream")))

    app.add_api_route("/v1/completions", inference, methods=["POST"])
    app.add_api_route("/v1/chat/completions", inference, methods=["POST"])

    async def admin_action(key: str, action: str, request: Request):
        if action not in ADMIN_KINDS:
            raise ModelNotFound(f"unknown action {action!r}")
        await gw.auth.admin(request.headers.get("authorization"))
        return await gw.fan_out(key, action)

    app.add_api_route("/admin/adapters/{key:path}/{action}", admin_action, methods=["POST"])

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/ready")
    async def ready():
        status, body = gw.ready()
        return JSONResponse(body, status_code=status)

    @app.get("/metrics")
    async def metrics():
        gw.ready()
        return Response(generate_latest(gw.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def passthrough(path: str, request: Request) -> Response:
        """Adapter API, model list, admin views: any engine answers (shared registry)."""
        caller = await gw.optional_caller(request)
        return await gw.forward(request, await read_body(request), caller=caller, adapter_id=None)

    app.add_api_route("/{path:path}", passthrough,
                      methods=["GET", "POST", "PUT", "PATCH", "DELETE"], include_in_schema=False)
    return app
