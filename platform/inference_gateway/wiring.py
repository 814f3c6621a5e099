"""What the settings turn on behind an inference gateway, around one engine
(``build_state`` calls :func:`attach` and keeps what it returns):

* ``--protocol-metrics-port``: :class:`~.metrics_listener.ProtocolMetricsListener`;
* ``--kv-events-endpoint``: a :class:`~.kv_events.KVEventPublisher` listening to the
  engine's prefix cache;
* ``--allow-runtime-lora-updating`` (with a registry): :class:`~.runtime_lora.RuntimeLoRA`
  for the routes (``app.py`` mounts them).

Each is stopped by :attr:`GatewaySide.cleanups` (the state runs them at close).
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from loramux.platform.inference_gateway.facts import public_name

if TYPE_CHECKING:
    from loramux.engine.async_engine import AsyncEngine
    from loramux.platform.adapter_api.service import AdapterService
    from loramux.platform.inference_gateway.kv_events import KVEventPublisher
    from loramux.platform.inference_gateway.metrics_listener import ProtocolMetricsListener
    from loramux.platform.inference_gateway.runtime_lora import RuntimeLoRA
    from loramux.platform.openai.resolver import ModelResolver
    from loramux.platform.settings import Settings


@dataclass
class GatewaySide:
    """What :func:`attach` started; ``cleanups`` stop it (run in reverse)."""

    protocol_metrics: ProtocolMetricsListener | None = None
    kv_events: KVEventPublisher | None = None
    runtime_lora: RuntimeLoRA | None = None
    cleanups: list[Callable[[], None]] = field(default_factory=list)

    def close(self) -> None:
        """Stop what was started, newest first (what :func:`attach` does when it fails)."""
        for fn in reversed(self.cleanups):
            with contextlib.suppress(Exception):
                fn()
        self.cleanups.clear()


def default_topic(settings: Settings, base_name: str) -> str:
    """``kv@<host>:<port>@<served model name>`` (llm-d reads ``kv@<pod>@<model>``)."""
    return f"kv@{socket.gethostname()}:{settings.port}@{base_name}"


def lora_identity(key: str) -> tuple[str, int]:
    """(lora_name, lora_id) of an engine adapter key in KV events: the name requests send,
    and an id that is stable per tenant and version (vLLM's deprecated field)."""
    import zlib

    return public_name(key), zlib.crc32(key.encode()) & 0x7FFFFFFF


def attach(engine: AsyncEngine, settings: Settings, resolver: ModelResolver,
           adapters: AdapterService | None) -> GatewaySide:
    """Start what ``settings`` asks for around ``engine`` (called once per built server);
    if one part fails to start, the parts started before are stopped and the error raised."""
    side = GatewaySide()
    try:
        _start(side, engine, settings, resolver, adapters)
    except BaseException:
        side.close()
        raise
    return side


def _start(side: GatewaySide, engine: AsyncEngine, s: Settings, resolver: ModelResolver,
           adapters: AdapterService | None) -> None:
    if s.protocol_metrics_port is not None:
        from loramux.platform.inference_gateway.facts import FactsBuilder
        from loramux.platform.inference_gateway.metrics_listener import ProtocolMetricsListener

        cc, spec = engine.config.cache, engine.config.speculative
        listener = ProtocolMetricsListener(
            s.host, s.protocol_metrics_port, engine.load_report,
            FactsBuilder(resolver.base.name, cc.enable_prefix_caching,
                         cc.gpu_memory_utilization, engine.lora_enabled,
                         spec.num_speculative_tokens if spec is not None else 0))
        side.protocol_metrics = listener
        side.cleanups.append(listener.close)
    if s.kv_events_endpoint:
        from loramux.platform.inference_gateway.kv_events import KVEventPublisher

        publisher = KVEventPublisher(
            s.kv_events_endpoint, s.kv_events_topic or default_topic(s, resolver.base.name),
            adapter_of=lora_identity, max_queue_size=s.kv_events_max_queue_size,
            hwm=s.kv_events_hwm)
        remove = engine.add_kv_listener(publisher)
        side.kv_events = publisher
        side.cleanups.append(publisher.close)
        side.cleanups.append(remove)
    if s.allow_runtime_lora_updating and adapters is not None:
        from loramux.platform.inference_gateway.runtime_lora import RuntimeLoRA

        side.runtime_lora = RuntimeLoRA(adapters, resolver, engine,
                                        lora_path_allow=s.lora_path_allow)
