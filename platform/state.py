"""The application state every route reaches through ``StateDep``: what it holds,
how :func:`build_state` wires it around one engine (and optionally a registry), and
how :func:`close_state` takes it down."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from loramux.adapters.arch import folder_family
from loramux.engine.async_engine import AsyncEngine
from loramux.platform.adapter_api.chat import ChatSettingsCheck
from loramux.platform.adapter_api.service import AdapterService
from loramux.platform.admin.fleet import LocalFleet
from loramux.platform.admin.service import AdminService
from loramux.platform.admin.session import Sessions
from loramux.platform.auth import Authenticator
from loramux.platform.builders import (
    build_authenticator,
    default_quotas,
    dependency_policy,
    error_context,
    request_limits,
    usage_policy,
)
from loramux.platform.bulkheads import Dependencies
from loramux.platform.identity import EngineKey
from loramux.platform.inference_gateway import wiring as inference_gateway
from loramux.platform.limits.tenant import build_limiter
from loramux.platform.metrics import Metrics
from loramux.platform.openai.gate import RequestGate
from loramux.platform.openai.resolver import ModelResolver, parse_lora_modules
from loramux.platform.openai.responses_api.service import ResponsesService, store_limits
from loramux.platform.openai.serving import OpenAIServing
from loramux.platform.openai.tool_config import build_parsing_config
from loramux.platform.probes import Report, dependency_report
from loramux.platform.settings import DEFAULT_MODEL_ALIASES, Settings
from loramux.platform.usage.recorder import UsageRecorder

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    from loramux.platform.inference_gateway.kv_events import KVEventPublisher
    from loramux.platform.inference_gateway.metrics_listener import ProtocolMetricsListener
    from loramux.platform.inference_gateway.runtime_lora import RuntimeLoRA
    from loramux.registry.service import RegistryService

VERSION = "0.1.0"


@dataclass
class AppState:
    """Everything one server runs on; built once per app (lifespan or ``create_app``)."""

    settings: Settings
    engine: AsyncEngine
    registry: RegistryService | None
    metrics: Metrics
    resolver: ModelResolver
    auth: Authenticator
    openai: OpenAIServing
    admin: AdminService
    adapters: AdapterService | None
    scratch_dir: Path
    admin_sessions: Sessions = field(default_factory=Sessions)
    owns_engine: bool = False
    owns_registry: bool = False
    cleanups: list[Callable[[], None]] = field(default_factory=list)
    gate: RequestGate | None = None
    """Request caps, chat-template rendering and tenant quotas (see openai/gate.py)."""
    deps: Dependencies = field(default_factory=Dependencies)
    """The database and object-store bulkheads every registry call runs in."""
    usage: UsageRecorder | None = None
    """The usage writer (finished requests' records to SQL); None without a registry."""
    protocol_metrics: ProtocolMetricsListener | None = None
    """The model-server protocol metrics listener (``--protocol-metrics-port``)."""
    kv_events: KVEventPublisher | None = None
    """The prefix-cache KV-event publisher (``--kv-events-endpoint``)."""
    runtime_lora: RuntimeLoRA | None = None
    """vLLM's load/unload API (``--allow-runtime-lora-updating``, with a registry)."""
    responses: ResponsesService | None = None
    """The Responses API (``/v1/responses``) over ``openai``'s chat completions."""

    async def dependency_report(self) -> Report:
        """Every dependency asked at once (``/ready``, the dashboard's overview)."""
        limiter = [self.gate.limiter.backend] if self.gate is not None else []
        return await dependency_report(self.deps, self.registry, limiter)


def base_model_names(settings: Settings, model_path: Path) -> list[str]:
    """The names the base model answers to (the first is listed)."""
    if settings.served_model_name:
        return list(settings.served_model_name)
    names = [model_path.name]
    if settings.model is None:
        names = list(dict.fromkeys([*DEFAULT_MODEL_ALIASES, *names]))
    elif settings.model not in names:
        names.append(settings.model)
    return names


def _own_s3_root(settings: Settings) -> str | None:
    """``s3://bucket/prefix/`` of the configured store; tenants import from
    ``imports/<tenant>/`` under it."""
    if not settings.s3_bucket:
        return None
    prefix = settings.s3_prefix.strip("/")
    return f"s3://{settings.s3_bucket}/{prefix + '/' if prefix else ''}"


def build_state(settings: Settings, engine: AsyncEngine,
                registry: RegistryService | None) -> AppState:
    """Wire the services around one engine (and optionally a registry); subscribes to
    the engine's adapter events and the registry's changes (undone by close_state). Bad
    tool-call / reasoning parser flags raise ``ParserStartupError`` before anything starts."""
    parsing = build_parsing_config(settings, engine.tokenizer, engine.model_path.name)
    metrics = Metrics(settings.goodput_ttft_ms / 1000, settings.goodput_tpot_ms / 1000)

    def drop_engine_key(key: str) -> None:
        """A deleted adapter or a removed version: its queued requests fail now, running
        ones finish."""
        message = (f"adapter {EngineKey.parse(key).name!r} (this version) was deleted before "
                   "this request started; send it again")

        engine.drop_adapter(key, message, timeout=30)

    policy = dependency_policy(settings)
    deps = Dependencies(policy)
    resolver = ModelResolver(
        base_model_names(settings, engine.model_path),
        static_modules=parse_lora_modules(settings.lora_modules),
        registry=registry,
        lora_enabled=engine.lora_enabled,
        ttl=settings.model_cache_ttl,
        drop_engine_key=drop_engine_key,
        deps=deps,
        base_family=folder_family(engine.model_path),
    )
    fingerprint = "fp_" + hashlib.sha256(
        f"loramux-{VERSION}-{engine.model_path}-{engine.dtype}".encode()
    ).hexdigest()[:10]
    data_dir = registry.tmp_dir if registry is not None else settings.data_dir
    scratch = Path(data_dir) / "uploads" if data_dir else Path(tempfile.gettempdir()) / "loramux-uploads"
    auth = build_authenticator(settings, registry, deps)
    behind_gateway = settings.role == "engine"  # gateways hold the fleet-wide quotas
    gate = RequestGate(
        build_limiter(None if behind_gateway else settings.redis_url,
                      redis_timeouts=(policy.redis_socket_timeout, policy.redis_connect_timeout)),
        request_limits(settings), registry, default_quotas(settings),
        quota_ttl=settings.quota_cache_ttl, enforce_quotas=not behind_gateway, deps=deps,
    )
    usage = build_usage_recorder(settings, registry, metrics)
    openai = OpenAIServing(
        engine, resolver, metrics, fingerprint=fingerprint, gate=gate,
        errors=error_context(settings), max_prompts=settings.max_prompts_per_request,
        usage=usage, parsing=parsing,
    )
    adapters = AdapterService(
        registry, resolver, scratch_dir=scratch, max_upload_bytes=settings.max_upload_bytes,
        s3_endpoint_url=settings.s3_endpoint_url, s3_import_allow=settings.s3_import_allow,
        own_s3_root=_own_s3_root(settings), flush_usage=usage.flush if usage else None,
        chat=ChatSettingsCheck(request_limits(settings), engine.tokenizer,
                               model_name=engine.model_path.name),
    ) if registry is not None else None
    fleet = LocalFleet(engine, metrics.activity)
    admin = AdminService(
        fleet, registry, resolver, metrics.activity, base_model=engine.model_path.name,
        dtype=engine.dtype, device=engine.device, base_family=resolver.base_family,
        weight_format=getattr(engine, "weight_format", None), weight_bytes=getattr(engine, "weight_bytes", None),
    )
    admin.goodput = metrics.goodput_report
    admin.flush_usage = usage.flush if usage is not None else None
    state = AppState(settings, engine, registry, metrics, resolver, auth, openai, admin,
                     adapters, scratch, gate=gate, deps=deps, usage=usage,
                     responses=ResponsesService(openai, registry, deps, store_limits(settings)))
    admin.health = state.dependency_report
    if registry is not None:
        state.cleanups.append(registry.subscribe(resolver.on_registry_event))
        state.cleanups.append(registry.subscribe(auth.on_registry_event))
        state.cleanups.append(registry.subscribe(gate.on_registry_event))
    if adapters is not None:
        state.cleanups.append(adapters.chat.close)
    state.cleanups.append(engine.add_adapter_listener(metrics.on_adapter_event))
    if registry is not None:
        state.cleanups.append(engine.add_adapter_listener(_broken_audit(registry, resolver)))
    state.cleanups.append(fleet.remove_listener)
    state.cleanups.append(deps.shutdown)
    if usage is not None:
        state.cleanups.append(usage.close)  # cleanups run reversed: after the ones added later
    _attach_inference_gateway(state)
    return state


def _attach_inference_gateway(state: AppState) -> None:
    """Start what the settings turn on behind an inference gateway (``wiring.attach``);
    its stops join the state's cleanups. A part that fails to start closes the state."""
    try:
        side = inference_gateway.attach(state.engine, state.settings, state.resolver,
                                        state.adapters)
    except BaseException:
        close_state(state)
        raise
    state.protocol_metrics, state.kv_events = side.protocol_metrics, side.kv_events
    state.runtime_lora = side.runtime_lora
    state.cleanups.extend(side.cleanups)


def build_usage_recorder(settings: Settings, registry: RegistryService | None,
                         metrics: Metrics) -> UsageRecorder | None:
    """The usage writer of a server with a registry (started), spilling to
    ``usage_spill_dir`` (default ``<data dir>/usage-spill``)."""
    if registry is None:
        return None
    spill = settings.usage_spill_dir
    if spill is None:
        spill = (Path(registry.tmp_dir).parent if registry.tmp_dir is not None
                 else Path(tempfile.gettempdir()) / "loramux") / "usage-spill"
    return UsageRecorder(registry.usage.append, spill, usage_policy(settings),
                         prune=registry.usage.prune, counters=metrics.usage).start()


def _broken_audit(registry: RegistryService, resolver) -> Callable[[str, str], None]:
    """An adapter listener that records a ``broken`` audit event (its outputs became
    non-finite while serving) in the registry, off the engine thread."""

    def record(key: str) -> None:
        adapter_id = resolver.adapter_id_of(key)
        if adapter_id is None:
            return
        try:
            registry.record_event(adapter_id, "broken", actor="engine",
                                  details={"reason": "non-finite outputs (adapter_numerics)"})
        except Exception:
            logger.exception("could not record the broken event of %s", key)

    def on_event(event: str, key: str) -> None:
        if event == "broken":
            threading.Thread(target=record, args=(key,), name="broken-audit", daemon=True).start()

    return on_event


async def aclose_state(state: AppState) -> None:
    """What needs the event loop to close (template workers, the limiter's connection),
    then :func:`close_state`."""
    if state.gate is not None:
        with contextlib.suppress(Exception):
            await state.gate.aclose()
    close_state(state)


def close_state(state: AppState) -> None:
    """Undo the subscriptions; stop the engine and the registry's pool when owned."""
    for fn in reversed(state.cleanups):
        with contextlib.suppress(Exception):
            fn()
    state.cleanups.clear()
    if state.owns_engine:
        state.engine.shutdown()
    if state.owns_registry and state.registry is not None:
        with contextlib.suppress(Exception):
            state.registry.db.dispose()
