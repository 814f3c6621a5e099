"""The FastAPI app factory: middleware, error handlers and the routers.

``create_app(settings, engine=None, registry=None)``: with an engine given (tests
inject a tiny-model :class:`AsyncEngine`) the app is ready at once; otherwise the
lifespan builds the engine and the registry from the settings at startup and
shuts the engine down at exit (see :mod:`loramux.platform.state`).
"""

from __future__ import annotations

import contextlib
import threading
from typing import TYPE_CHECKING

from fastapi import Request
from starlette.concurrency import run_in_threadpool

from loramux.engine import omp_threads
from loramux.engine.async_engine import AsyncEngine
from loramux.platform import ops
from loramux.platform.adapter_api import routes as adapter_routes
from loramux.platform.admin import pages as admin_pages
from loramux.platform.admin import routes as admin_routes
from loramux.platform.builders import engine_config, error_context, open_registry
from loramux.platform.drain import Drain
from loramux.platform.error_handlers import install_error_handlers
from loramux.platform.errors import APIError
from loramux.platform.inference_gateway import routes as runtime_lora_routes
from loramux.platform.middleware import RequestContextMiddleware
from loramux.platform.openai import routes as openai_routes
from loramux.platform.openai.responses_api import routes as responses_routes
from loramux.platform.priority import lower_front_end
from loramux.platform.server import LoramuxApp, app_of
from loramux.platform.settings import Settings
from loramux.platform.state import VERSION, aclose_state, build_state
from loramux.platform.tenant_api import routes as tenant_routes
from loramux.platform.usage import routes as usage_routes

if TYPE_CHECKING:
    from loramux.registry.service import RegistryService


def build_engine(settings: Settings) -> AsyncEngine:
    """The engine for these settings (loads the model: seconds to minutes)."""
    from loramux.engine.engine import LLMEngine

    return AsyncEngine(LLMEngine(engine_config(settings)))


def record_rejection(request: Request, err: APIError) -> None:
    """The app's 429 listener (``install_error_handlers``' ``on_rejection``): counts the
    rejection by code (``loramux_requests_rejected_total{reason}``) and notes it under the
    caller's tenant when the request got as far as authentication."""
    state = app_of(request).services
    if state is None:
        return
    caller = getattr(request.state, "caller", None)  # set by deps.get_caller
    tenant_id = caller.tenant_id if caller is not None else None
    state.metrics.rejected.labels(err.code or "rate_limited").inc()
    state.metrics.activity.rejected(tenant_id, err.code, err.message)


def create_app(
    settings: Settings | None = None,
    engine: AsyncEngine | None = None,
    registry: RegistryService | None = None,
) -> LoramuxApp:
    """The HTTP service. Give ``engine`` (and ``registry``) to serve what you built;
    leave them out and the lifespan builds both from ``settings``."""
    settings = settings or Settings()

    @contextlib.asynccontextmanager
    async def lifespan(app: LoramuxApp):
        state = app.services
        if state is None:
            built_engine = await run_in_threadpool(build_engine, settings)
            lower_front_end(settings.front_end_nice)  # this loop's thread, below the engine's
            omp_threads.confine_thread()  # and its torch work on itself alone (omp_threads.py)
            try:
                built_registry = registry
                if built_registry is None:
                    built_registry = await run_in_threadpool(
                        omp_threads.alone, open_registry, settings, built_engine.model_path
                    )
                state = build_state(settings, built_engine, built_registry)
            except BaseException:
                built_engine.shutdown()
                raise
            state.owns_engine = True
            state.owns_registry = registry is None
            app.serve(state)
            # a drain that times out fails the engine's open requests (error events)
            app.drain.on_timeout.append(lambda: threading.Thread(
                target=built_engine.shutdown, name="drain-timeout", daemon=True).start())
            if app.on_ready is not None:
                # its torch work (the demo adapter's checks) alone: a worker thread's pool
                # beside the engine's would throttle every step (omp_threads.py)
                await run_in_threadpool(omp_threads.alone, app.on_ready, state)
        try:
            yield
        finally:
            state = app.services
            if state is not None and state.owns_engine:
                await aclose_state(state)
            elif state is not None and state.gate is not None:
                await state.gate.aclose()

    drain = Drain()
    app = LoramuxApp(
        drain=drain,
        title="loramux",
        version=VERSION,
        summary="OpenAI-compatible multi-LoRA serving with a tenant adapter API.",
        lifespan=lifespan,
        root_path=settings.root_path,
    )
    install_error_handlers(app, error_context(settings), on_rejection=record_rejection)
    app.add_middleware(
        RequestContextMiddleware,
        max_request_bytes=settings.max_request_bytes,
        unlimited_paths=("/v1/adapters",),
        drain=drain,
    )
    app.include_router(openai_routes.router)
    app.include_router(responses_routes.router)
    app.include_router(adapter_routes.router)
    app.include_router(tenant_routes.router)
    app.include_router(usage_routes.router)
    app.include_router(admin_routes.router)
    app.include_router(admin_pages.router)
    app.include_router(ops.router)
    if settings.allow_runtime_lora_updating:  # vLLM mounts them only when allowed, too
        app.include_router(runtime_lora_routes.router)
    if engine is not None:
        app.serve(build_state(settings, engine, registry))
    return app
