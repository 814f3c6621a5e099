"""What the settings turn on behind an inference gateway, attached to a built
:class:`~loramux.platform.state.AppState` (``build_state`` calls :func:`attach`):

* ``--protocol-metrics-port``: :class:`~.metrics_listener.ProtocolMetricsListener`;
* ``--kv-events-endpoint``: a :class:`~.kv_events.KVEventPublisher` listening to the
  engine's prefix cache;
* ``--allow-runtime-lora-updating`` (with a registry): :class:`~.runtime_lora.RuntimeLoRA`
  for the routes (``app.py`` mounts them).

Each is stopped by the state's cleanups.
"""

from __future__ import annotations

import socket
from typing import TYPE_CHECKING

from loramux.platform.inference_gateway.facts import public_name

if TYPE_CHECKING:
    from loramux.platform.state import AppState


def default_topic(state: AppState) -> str:
    """``kv@<host>:<port>@<served model name>`` (llm-d reads ``kv@<pod>@<model>``)."""
    s = state.settings
    return f"kv@{socket.gethostname()}:{s.port}@{state.resolver.base.name}"


def lora_identity(key: str) -> tuple[str, int]:
    """(lora_name, lora_id) of an engine adapter key in KV events: the name requests send,
    and an id that is stable per tenant and version (vLLM's deprecated field)."""
    import zlib

    return public_name(key), zlib.crc32(key.encode()) & 0x7FFFFFFF


def attach(state: AppState) -> None:
    """Start what ``state.settings`` asks for; register the stops in ``state.cleanups``."""
    s = state.settings
    engine = state.engine
    if s.protocol_metrics_port is not None:
        from loramux.platform.inference_gateway.facts import FactsBuilder
        from loramux.platform.inference_gateway.metrics_listener import ProtocolMetricsListener

        cc, spec = engine.config.cache, engine.config.speculative
        listener = ProtocolMetricsListener(
            s.host, s.protocol_metrics_port, engine.load_report,
            FactsBuilder(state.resolver.base.name, cc.enable_prefix_caching,
                         cc.gpu_memory_utilization, engine.lora_enabled,
                         spec.num_speculative_tokens if spec is not None else 0))
        state.protocol_metrics = listener
        state.cleanups.append(listener.close)
    if s.kv_events_endpoint:
        from loramux.platform.inference_gateway.kv_events import KVEventPublisher

        publisher = KVEventPublisher(
            s.kv_events_endpoint, s.kv_events_topic or default_topic(state),
            adapter_of=lora_identity, max_queue_size=s.kv_events_max_queue_size,
            hwm=s.kv_events_hwm)
        remove = engine.add_kv_listener(publisher)
        state.kv_events = publisher
        state.cleanups.append(publisher.close)
        state.cleanups.append(remove)
    if s.allow_runtime_lora_updating and state.adapters is not None:
        from loramux.platform.inference_gateway.runtime_lora import RuntimeLoRA

        state.runtime_lora = RuntimeLoRA(state.adapters, state.resolver, engine,
                                         lora_path_allow=s.lora_path_allow)
