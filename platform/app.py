"""The FastAPI app factory.

``create_app(settings, engine=None, registry=None)``: with an engine given (tests
inject a tiny-model :class:`AsyncEngine`) the app is ready at once; otherwise the
lifespan builds the engine and the registry from the settings at startup and
shuts the engine down at exit.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from starlette.concurrency import run_in_threadpool

from loramux.engine.async_engine import AsyncEngine
from loramux.platform.adapter_service import AdapterService
from loramux.platform.admin_service import AdminService
from loramux.platform.api import adapters as adapters_api
from loramux.platform.api import admin as admin_api
from loramux.platform.api import openai as openai_api
from loramux.platform.api import ops as ops_api
from loramux.platform.auth import Authenticator
from loramux.platform.errors import install_error_handlers
from loramux.platform.metrics import Metrics
from loramux.platform.middleware import RequestContextMiddleware
from loramux.platform.models import ModelResolver, parse_lora_modules
from loramux.platform.serving import OpenAIServing
from loramux.platform.settings import DEFAULT_MODEL_ALIASES, Settings
from loramux.platform.state import AppState

logger = logging.getLogger(__name__)

VERSION = "0.1.0"


def build_engine(settings: Settings) -> AsyncEngine:
    """The engine for these settings (loads the model: seconds to minutes)."""
    from loramux.engine.config import (
        CacheConfig,
        EngineConfig,
        LoRAConfig,
        ModelConfig,
        SchedulerConfig,
    )
    from loramux.engine.engine import LLMEngine

    config = EngineConfig(
        model=ModelConfig(
            model=settings.model, dtype=settings.dtype, device=settings.device,
            max_model_len=settings.max_model_len, seed=settings.seed,
        ),
        cache=CacheConfig(
            block_size=settings.block_size,
            gpu_memory_utilization=settings.gpu_memory_utilization,
            kv_cache_memory=settings.kv_cache_memory,
            num_gpu_blocks_override=settings.num_gpu_blocks_override,
            enable_prefix_caching=settings.enable_prefix_caching,
        ),
        scheduler=SchedulerConfig(
            max_num_seqs=settings.max_num_seqs,
            max_num_batched_tokens=settings.max_num_batched_tokens,
            enable_chunked_prefill=settings.enable_chunked_prefill,
            max_waiting=settings.max_waiting,
        ),
        lora=LoRAConfig(
            max_loras=settings.max_loras, max_lora_rank=settings.max_lora_rank,
            max_cpu_loras=settings.max_cpu_loras, lora_backend=settings.lora_backend,
        ) if settings.enable_lora else None,
    )
    return AsyncEngine(LLMEngine(config))


def build_registry(settings: Settings, model_path: Path) -> Any:
    """The registry for these settings, validating uploads against the served model."""
    from loramux.registry import build_registry as _build

    return _build(
        database_url=settings.database_url,
        s3_bucket=settings.s3_bucket,
        s3_endpoint_url=settings.s3_endpoint_url,
        s3_prefix=settings.s3_prefix,
        data_dir=settings.data_dir,
        base_model=str(model_path),
        max_lora_rank=settings.max_lora_rank,
    )


def base_model_names(settings: Settings, model_path: Path) -> list[str]:
    if settings.served_model_name:
        return list(settings.served_model_name)
    names = [model_path.name]
    if settings.model is None:
        names = list(dict.fromkeys([*DEFAULT_MODEL_ALIASES, *names]))
    elif settings.model not in names:
        names.append(settings.model)
    return names


def _count_evictions(engine: AsyncEngine, metrics: Metrics):
    """Count slot evictions per adapter: wraps the manager's ``_free_slot`` once and
    fans out to every app's metrics (returns the undo for this app)."""
    mgr = engine.engine.lora_manager
    if mgr is None:
        return lambda: None
    listeners = getattr(mgr, "_loramux_evict_listeners", None)
    if listeners is None:
        listeners = []
        original = mgr._free_slot

        def free_slot(key: str) -> None:
            had = key in mgr.slot_of
            original(key)
            if had:
                for fn in list(listeners):
                    fn(key)

        mgr._free_slot = free_slot
        mgr._loramux_evict_listeners = listeners
    listeners.append(metrics.count_eviction)
    return lambda: listeners.remove(metrics.count_eviction)


def build_state(settings: Settings, engine: AsyncEngine, registry: Any | None) -> AppState:
    """Wire the services around one engine (and optionally a registry)."""
    llm = engine.engine
    metrics = Metrics()
    mgr = llm.lora_manager

    def drop_engine_key(key: str) -> None:
        if mgr is not None and engine.is_running:
            engine.call_sync(lambda: mgr.drop(key), timeout=30)

    resolver = ModelResolver(
        base_model_names(settings, Path(llm.model_path)),
        static_modules=parse_lora_modules(settings.lora_modules),
        registry=registry,
        lora_enabled=mgr is not None,
        ttl=settings.model_cache_ttl,
        drop_engine_key=drop_engine_key,
    )
    fingerprint = "fp_" + hashlib.sha256(
        f"loramux-{VERSION}-{llm.model_path}-{llm.model.dtype}".encode()
    ).hexdigest()[:10]
    data_dir = getattr(registry, "tmp_dir", None) or settings.data_dir
    scratch = Path(data_dir) / "uploads" if data_dir else Path(
        __import__("tempfile").gettempdir()
    ) / "loramux-uploads"
    admin_key = settings.admin_key.get_secret_value() if settings.admin_key else None
    state = AppState(
        settings=settings,
        engine=engine,
        registry=registry,
        metrics=metrics,
        resolver=resolver,
        auth=Authenticator(registry, admin_key=admin_key, allow_anonymous=settings.allow_anonymous),
        openai=OpenAIServing(
            engine, resolver, metrics, fingerprint=fingerprint,
            retry_after=settings.retry_after_seconds, max_prompts=settings.max_prompts_per_request,
        ),
        admin=AdminService(engine, registry, resolver, metrics),
        adapters=AdapterService(
            registry, resolver, scratch_dir=scratch, max_upload_bytes=settings.max_upload_bytes,
            s3_endpoint_url=settings.s3_endpoint_url,
        ) if registry is not None else None,
        scratch_dir=scratch,
    )
    if registry is not None:
        registry.subscribe(resolver.on_registry_event)
        state.cleanups.append(lambda: _unsubscribe(registry, resolver.on_registry_event))
    state.cleanups.append(_count_evictions(engine, metrics))
    return state


def _unsubscribe(registry: Any, listener) -> None:
    with contextlib.suppress(AttributeError, ValueError):
        registry._listeners.remove(listener)


def close_state(state: AppState) -> None:
    for fn in reversed(state.cleanups):
        with contextlib.suppress(Exception):
            fn()
    state.cleanups.clear()
    if state.owns_engine:
        state.engine.shutdown()
    if state.owns_registry and state.registry is not None:
        with contextlib.suppress(Exception):
            state.registry.db.dispose()


def create_app(
    settings: Settings | None = None,
    engine: AsyncEngine | None = None,
    registry: Any | None = None,
) -> FastAPI:
    """The HTTP service. Give ``engine`` (and ``registry``) to serve what you built;
    leave them out and the lifespan builds both from ``settings``."""
    settings = settings or Settings()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        state: AppState | None = getattr(app.state, "loramux", None)
        if state is None:
            built_engine = await run_in_threadpool(build_engine, settings)
            try:
                built_registry = registry
                if built_registry is None:
                    built_registry = await run_in_threadpool(
                        build_registry, settings, Path(built_engine.engine.model_path)
                    )
                state = build_state(settings, built_engine, built_registry)
            except BaseException:
                built_engine.shutdown()
                raise
            state.owns_engine = True
            state.owns_registry = registry is None
            app.state.loramux = state
            hook = getattr(app.state, "on_ready", None)
            if hook is not None:
                await run_in_threadpool(hook, state)
        try:
            yield
        finally:
            if state is not None and state.owns_engine:
                close_state(state)

    app = FastAPI(
        title="loramux",
        version=VERSION,
        summary="OpenAI-compatible multi-LoRA serving with a tenant adapter API.",
        lifespan=lifespan,
        root_path=settings.root_path,
    )
    install_error_handlers(app)
    app.add_middleware(
        RequestContextMiddleware,
        max_request_bytes=settings.max_request_bytes,
        unlimited_paths=("/v1/adapters",),
    )
    app.include_router(openai_api.router)
    app.include_router(adapters_api.router)
    app.include_router(admin_api.router)
    app.include_router(ops_api.router)
    if engine is not None:
        app.state.loramux = build_state(settings, engine, registry)
    return app
