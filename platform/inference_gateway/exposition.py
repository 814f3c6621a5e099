"""The model-server protocol metrics: :class:`ProtocolFacts` (plain data, JSON on the
wire to the metrics process) and their Prometheus exposition under vLLM's names, so an
endpoint picker's default ``vllm`` engine type reads loramux with no configuration.

Imported by the metrics process: only the standard library and ``prometheus_client``.

Series (gauges; ``model_name`` is the served base model, ``engine`` is ``"0"``):

* ``vllm:num_requests_running``, ``vllm:num_requests_waiting``: sequences in the running
  batch / the waiting queue (a request with ``n`` > 1 counts each of its sequences, as
  vLLM V1's child requests);
* ``vllm:kv_cache_usage_perc``: fraction (0..1) of KV blocks in use (also as
  ``vllm:gpu_cache_usage_perc``, its name before vLLM 0.10, which older pickers read);
* ``vllm:cache_config_info{block_size, num_gpu_blocks, ...}`` = 1;
* ``vllm:lora_requests_info{max_lora, running_lora_adapters, waiting_lora_adapters}`` =
  the Unix time of the sample (the picker takes the newest series); ``max_lora`` is the
  number of device slots, the lists are the names (as requests send them in ``model``)
  of the adapters of running and of waiting sequences;
* ``vllm:lora_adapter_loaded{adapter_name, level, pinned}`` = 1 per resident adapter
  name: ``level="gpu"`` in a device slot (on a CPU engine too: ready for the next step),
  ``"cpu"`` in the CPU tier only; an adapter only on disk has no series;
* ``vllm:num_gpu_loaded_lora_adapters``, ``vllm:num_cpu_loaded_lora_adapters``,
  ``vllm:max_gpu_lora_adapters``: adapters in device slots, in the CPU tier only, slots.

Counters, only when speculative decoding is configured (as vLLM v1's ``SpecDecodingProm``:
the same names, documentation and ``model_name``/``engine`` labels; the text format writes
them as ``<name>_total``), summed over all adapters since the engine started:

* ``vllm:spec_decode_num_drafts``: verify steps with at least one drafted token;
* ``vllm:spec_decode_num_draft_tokens``, ``vllm:spec_decode_num_accepted_tokens``;
* ``vllm:spec_decode_num_accepted_tokens_per_pos{position}``: drafts whose token at
  ``position`` (``"0"`` .. ``num_speculative_tokens - 1``, every one present from the start)
  was accepted.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

ENGINE_INDEX = "0"
"""vLLM's ``engine`` label: one engine per server here."""


@dataclass(frozen=True)
class ResidentAdapter:
    name: str
    level: str
    """``gpu`` (in a device slot) or ``cpu`` (in the CPU tier only)."""
    pinned: bool


@dataclass(frozen=True)
class ProtocolFacts:
    """Everything the protocol series say, for one moment of one engine. Names only: no
    tenant ids, no engine keys (see ``facts.py`` for how they are derived)."""

    model_name: str
    taken_at: float
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    block_size: int
    num_gpu_blocks: int
    enable_prefix_caching: bool
    gpu_memory_utilization: float
    lora_enabled: bool
    max_lora: int = 0
    running_adapters: tuple[str, ...] = ()
    waiting_adapters: tuple[str, ...] = ()
    resident: tuple[ResidentAdapter, ...] = field(default_factory=tuple)
    num_gpu_loaded: int = 0
    num_cpu_loaded: int = 0
    num_speculative_tokens: int = 0
    """Speculative decoding's tokens per draft (``--speculative-config``); 0 = off (no
    ``vllm:spec_decode_*`` series)."""
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: tuple[int, ...] = ()
    """Accepted drafted tokens by position, ``num_speculative_tokens`` long."""

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, raw: bytes | str) -> ProtocolFacts:
        d = json.loads(raw)
        d["running_adapters"] = tuple(d["running_adapters"])
        d["waiting_adapters"] = tuple(d["waiting_adapters"])
        d["resident"] = tuple(ResidentAdapter(**r) for r in d["resident"])
        d["spec_accepted_per_pos"] = tuple(d.get("spec_accepted_per_pos", ()))
        return cls(**d)


def metric_families(f: ProtocolFacts) -> list:
    """The protocol series of ``f`` (what :func:`render` writes)."""
    base = ["model_name", "engine"]
    ids = [f.model_name, ENGINE_INDEX]

    def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
        g = GaugeMetricFamily(name, doc, labels=base)
        g.add_metric(ids, value)
        return g

    out = [
        gauge("vllm:num_requests_running", "Number of requests in model execution batches.",
              f.num_running),
        gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
              f.num_waiting),
        gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
              f.kv_cache_usage),
        gauge("vllm:gpu_cache_usage_perc", "KV-cache usage (vllm:kv_cache_usage_perc's name "
              "before vLLM 0.10). 1 means 100 percent usage.", f.kv_cache_usage),
    ]
    info = {"block_size": str(f.block_size), "num_gpu_blocks": str(f.num_gpu_blocks),
            "enable_prefix_caching": str(f.enable_prefix_caching),
            "gpu_memory_utilization": str(f.gpu_memory_utilization), "engine": ENGINE_INDEX}
    cache = GaugeMetricFamily("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                              labels=list(info))
    cache.add_metric(list(info.values()), 1.0)
    out.append(cache)
    if f.num_speculative_tokens:
        out += spec_decode_families(f, base, ids)
    if not f.lora_enabled:
        return out
    lora = GaugeMetricFamily(
        "vllm:lora_requests_info", "Running stats on lora requests.",
        labels=["max_lora", "waiting_lora_adapters", "running_lora_adapters"])
    lora.add_metric([str(f.max_lora), ",".join(f.waiting_adapters), ",".join(f.running_adapters)],
                    f.taken_at)
    out.append(lora)
    loaded = GaugeMetricFamily(
        "vllm:lora_adapter_loaded", "1 while the LoRA adapter is loaded at this level "
        "(gpu: a device slot, ready for the next step; cpu: CPU memory).",
        labels=[*base, "adapter_name", "level", "pinned"])
    for a in f.resident:
        loaded.add_metric([*ids, a.name, a.level, "true" if a.pinned else "false"], 1.0)
    out += [
        loaded,
        gauge("vllm:num_gpu_loaded_lora_adapters", "LoRA adapters in device slots.",
              f.num_gpu_loaded),
        gauge("vllm:num_cpu_loaded_lora_adapters", "LoRA adapters in CPU memory only.",
              f.num_cpu_loaded),
        gauge("vllm:max_gpu_lora_adapters", "Device slots for LoRA adapters (max_loras).",
              f.max_lora),
    ]
    return out


def spec_decode_families(f: ProtocolFacts, base: list[str], ids: list[str]) -> list:
    """vLLM v1's speculative-decoding counters of ``f`` (``vllm/v1/spec_decode/metrics.py``)."""

    def counter(name: str, doc: str, value: int) -> CounterMetricFamily:
        c = CounterMetricFamily(name, doc, labels=base)
        c.add_metric(ids, value)
        return c

    per_pos = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                  "Accepted tokens per draft position.", labels=[*base, "position"])
    accepted = list(f.spec_accepted_per_pos)[: f.num_speculative_tokens]
    accepted += [0] * (f.num_speculative_tokens - len(accepted))
    for pos, n in enumerate(accepted):
        per_pos.add_metric([*ids, str(pos)], n)
    return [
        counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", f.spec_num_drafts),
        counter("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.",
                f.spec_num_draft_tokens),
        counter("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.",
                f.spec_num_accepted_tokens),
        per_pos,
    ]


class _Collector:
    def __init__(self, facts: ProtocolFacts) -> None:
        self.facts = facts

    def collect(self):
        return metric_families(self.facts)


def render(facts: ProtocolFacts) -> bytes:
    """``facts`` in the Prometheus text format (0.0.4), by prometheus_client."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector(facts))
    return generate_latest(registry)
