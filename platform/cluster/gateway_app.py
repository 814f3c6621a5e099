"""The gateway's HTTP app: the routes around a built :class:`~.gateway.Gateway` (inference
with the tenant's quota held for the answer's life, the admin dashboard and API over every
engine, probes, metrics, and a pass-through of every other route to one engine)."""

from __future__ import annotations

import contextlib
import json

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.responses import StreamingResponse

from loramux.platform.admin import pages as admin_pages
from loramux.platform.admin import routes as admin_routes
from loramux.platform.cluster.gateway import Gateway
from loramux.platform.cluster.request_body import prompt_text
from loramux.platform.cluster.routing import prefix_hashes
from loramux.platform.cluster.schemas import GatewayReadiness
from loramux.platform.error_handlers import install_error_handlers
from loramux.platform.errors import DEFAULT_CONTEXT, BadRequest, ErrorContext, PayloadTooLarge
from loramux.platform.openai.versions import pinned_version
from loramux.platform.probes import PROBE_TIMEOUT_S
from loramux.platform.server import LoramuxApp


def create_gateway_app(gw: Gateway, *, on_shutdown=(), admin=None,
                       errors: ErrorContext = DEFAULT_CONTEXT) -> LoramuxApp:
    """The gateway's HTTP app around a built :class:`Gateway`; with ``admin`` (a
    :class:`~.gateway_admin.GatewayAdminState`) it serves the dashboard and admin API.
    ``errors``: the Retry-After values of error answers."""
    app = LoramuxApp(title="loramux gateway", lifespan=_lifespan(gw, on_shutdown))
    install_error_handlers(app, errors)
    app.gateway = gw
    inference = _inference(gw)
    app.add_api_route("/v1/completions", inference, methods=["POST"])
    app.add_api_route("/v1/chat/completions", inference, methods=["POST"])
    app.add_api_route("/v1/responses", inference, methods=["POST"])  # retrieve/delete: passthrough

    if admin is not None:  # the dashboard and admin API over every engine
        app.admin_state = admin
        app.include_router(admin_routes.router)
        app.include_router(admin_pages.router)
    _add_probes(app, gw)

    async def passthrough(path: str, request: Request) -> Response:
        """Adapter API, model list, admin views: any engine answers (shared registry)."""
        caller = await gw.optional_caller(request)
        return await gw.forward(request, await _read_body(gw, request), caller=caller,
                                adapter_id=None)

    app.add_api_route("/{path:path}", passthrough,
                      methods=["GET", "POST", "PUT", "PATCH", "DELETE"], include_in_schema=False)
    return app


def _lifespan(gw: Gateway, on_shutdown):
    """At shutdown: ``on_shutdown`` (the view's ticker, the event subscription, the
    bulkheads), then the gateway's HTTP client and limiter."""

    @contextlib.asynccontextmanager
    async def lifespan(app: LoramuxApp):
        try:
            yield
        finally:
            for fn in on_shutdown:
                with contextlib.suppress(Exception):
                    fn()
            await gw.http.aclose()
            if gw.limiter is not None:
                await gw.limiter.aclose()

    return lifespan


async def _read_body(gw: Gateway, request: Request) -> bytes:
    body = await request.body()
    if len(body) > gw.max_request_bytes and not request.url.path.startswith("/v1/adapters"):
        raise PayloadTooLarge(f"request body over {gw.max_request_bytes} bytes")
    return body


def _inference(gw: Gateway):
    """The completions, chat and Responses route: authenticate, hold the tenant's quota,
    resolve the adapter (version), route by prefix and forward to one engine."""

    async def inference(request: Request) -> Response:
        body = await _read_body(gw, request)
        try:
            parsed = json.loads(body)
        except ValueError:
            raise BadRequest("the body is not valid JSON") from None
        if not isinstance(parsed, dict) or not isinstance(parsed.get("model"), str):
            raise BadRequest("`model` is required", param="model")
        caller = await gw.auth.caller(request.headers.get("authorization"))
        stack = contextlib.AsyncExitStack()  # holds the tenant's quota
        relayed = False
        try:
            hold = await gw.hold_quota(caller, parsed, stack)
            user = parsed.get("user") if isinstance(parsed.get("user"), str) else None
            adapter, version = await gw.resolve(caller, parsed["model"], user=user,
                                                pinned=pinned_version(request.headers))
            cfg = gw.router.config
            prefixes = prefix_hashes(gw.prefix_owner(adapter), prompt_text(parsed),
                                     chunk_chars=cfg.prefix_chunk_chars,
                                     max_chunks=cfg.max_prefix_chunks)
            resp = await gw.forward(request, body, caller=caller, adapter_id=adapter,
                                    prefixes=prefixes, stream=bool(parsed.get("stream")),
                                    hold=hold, done=stack.aclose, version=version)
            relayed = isinstance(resp, StreamingResponse)  # the stream releases it
            return resp
        finally:
            if not relayed:
                await stack.aclose()

    return inference


def _add_probes(app: LoramuxApp, gw: Gateway) -> None:
    """``/health``, ``/ready`` (the view, Redis, the database) and ``/metrics``."""

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/ready", response_model=GatewayReadiness)
    async def ready():
        status, body = gw.ready()
        await gw.probe_database(body, PROBE_TIMEOUT_S)
        return JSONResponse(body.model_dump(), status_code=status)

    @app.get("/metrics")
    async def metrics():
        gw.ready()
        return Response(generate_latest(gw.metrics.registry), media_type=CONTENT_TYPE_LATEST)
