"""Response bodies of the admin JSON API (``/admin/...``); the pages render the same."""

from __future__ import annotations

from datetime import datetime
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel

from loramux.registry.tenants import ApiKeyInfo

if TYPE_CHECKING:
    from loramux.platform.cluster.protocol import EngineRecord


class ResidencyRow(BaseModel):
    """One adapter: where it sits (tier ``gpu`` | ``device`` | ``cpu`` | ``disk`` |
    ``store``) and what the engine, the registry and the request path know of it."""

    key: str
    """The engine key, ``<tenant id>/<name>@<digest>``."""
    name: str
    tier: str
    slot: int | None = None
    pinned: bool = False
    rank: int | None = None
    kind: str | None = None
    """``LoRA`` or ``DoRA``."""
    in_use: bool = False
    loading: bool = False
    load_seconds: float | None = None
    """Seconds of the adapter's last disk → CPU tier load."""
    slot_seconds: float | None = None
    """Seconds of its last CPU tier → device slot copy."""
    error: str | None = None
    source: Literal["engine", "static", "registry"] = "engine"
    tenant: str | None = None
    adapter: str | None = None
    """The adapter's name as its tenant calls it."""
    version: int | None = None
    size_bytes: int | None = None
    engine: str = "local"
    """The engine this row describes (one row per adapter and engine)."""
    evict_pending: bool = False
    """An eviction waits for the running requests that use it."""
    in_flight: int = 0
    requests_1m: int = 0
    tokens_1m: int = 0
    tokens_per_s: list[float] = []
    """Generated tokens per second, oldest first (the sparkline)."""
    last_used: datetime | None = None


class EngineSummary(BaseModel):
    """One engine's numbers (the Overview shows one card per engine)."""

    id: str = "local"
    role: str = "all"
    running: int
    waiting: int
    kv_cache_usage: float
    num_preemptions: int
    max_loras: int
    slots_used: int = 0
    max_cpu_loras: int | None = None
    cpu_used: int = 0
    evictions: int
    lora_enabled: bool
    adapter_loads: dict[str, dict[str, float]] = {}
    """Adapter loads since start per tier (``store`` | ``disk`` | ``cpu`` → slot):
    ``{"loads": n, "seconds": total}``."""
    prefix_cache_hit_rate: float | None = None
    """Fraction of looked-up prompt blocks found in the prefix cache (``EngineStats``);
    None (shown as n/a) when the engine's report carries none."""
    tokens_per_s: float = 0.0
    healthy: bool = True
    cpu_kernels: str | None = None
    """The engine's compiled CPU kernels: ``ok`` / ``disabled`` / ``degraded`` (``EngineStats``);
    None (shown as n/a) when the engine's report carries none."""
    cpu_kernels_reason: str | None = None
    """Why they are not ``ok`` (the admin sees paths)."""

    @classmethod
    def of(cls, record: EngineRecord) -> EngineSummary:
        """The card of a cluster engine, from its heartbeat record."""
        return cls(
            id=record.engine_id, role="engine", running=record.running, waiting=record.waiting,
            kv_cache_usage=record.kv_usage, num_preemptions=0, max_loras=record.max_loras,
            slots_used=len(record.resident), cpu_used=len(record.resident | record.cpu_resident),
            evictions=0, lora_enabled=record.max_loras > 0,
            prefix_cache_hit_rate=record.prefix_cache_hit_rate, healthy=True)


class Residency(BaseModel):
    object: Literal["list"] = "list"
    data: list[ResidencyRow]
    engine: EngineSummary
    """The first engine (all-in-one: the only one)."""


class Goodput(BaseModel):
    """Finished requests of this server checked against the goodput targets."""
    ttft_ms: float
    tpot_ms: float
    met: int
    checked: int
    share: float | None
    """``met / checked``; None before the first checked request."""
    tenants: dict[str, dict[str, int]] = {}
    """Per tenant (its name; ``-`` for requests without one): ``{"met": n, "checked": n}``."""


class Overview(BaseModel):
    base_model: str
    base_family: str | None = None
    """The base model's family and architecture (``qwen3 (Qwen3ForCausalLM)``)."""
    dtype: str
    device: str
    weight_format: str | None = None
    """How the base's weights are stored: ``float`` or the quantization format
    (``compressed-tensors pack-quantized (...)``, ``awq ...``); None: not reported."""
    weight_bytes: int | None = None
    """Bytes the base's weights take in memory (quantized ones as stored)."""
    engines: list[EngineSummary]
    dependencies: dict[str, str] = {}
    """``ok`` / ``degraded`` / ``down`` per dependency (database, object store, redis)."""
    dependency_reasons: dict[str, str] = {}
    """Why each failing dependency failed (the admin sees addresses)."""
    goodput: Goodput | None = None
    """Share of requests that met both the TTFT and the TPOT target (this server's)."""


class ActionResult(BaseModel):
    key: str
    action: str
    done: bool
    detail: str | None = None
    deferred: bool = False
    """``evict`` of an adapter running requests use: the slot frees once they finish."""
    engines: list[str] = []


class QuotaUse(BaseModel):
    name: str
    used: int | None
    """None: not measured here (the limiter holds it)."""
    limit: int | None
    """None: unlimited."""


class RejectionInfo(BaseModel):
    at: datetime
    code: str | None
    message: str


class TenantInfo(BaseModel):
    id: int
    name: str
    quotas: list[QuotaUse]
    rejections: list[RejectionInfo]
    keys: list[ApiKeyInfo]
    """Prefix, label, dates: never the key itself."""


class TenantList(BaseModel):
    object: Literal["list"] = "list"
    data: list[TenantInfo]


class AuditEvent(BaseModel):
    at: datetime
    kind: str
    tenant: str | None
    subject: str
    """The adapter name, or the key prefix for key events."""
    actor: str | None
    details: dict | None = None


class AuditLog(BaseModel):
    object: Literal["list"] = "list"
    data: list[AuditEvent]


class ReleaseVersion(BaseModel):
    """One version of an adapter on the dashboard: its share of the rollout and its last
    hour's numbers (every server's requests, from the usage records)."""

    version: int
    weight: int
    created_at: datetime
    size_bytes: int
    sha256: str
    requests: int = 0
    errors: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    ttft_p50_ms: float | None = None
    ttft_p99_ms: float | None = None
    tpot_p50_ms: float | None = None
    tpot_p99_ms: float | None = None


class ReleaseRow(BaseModel):
    """One tenant adapter: its versions and its rollout."""

    tenant: str | None
    tenant_id: int
    adapter: str
    sticky: str
    follow_latest: bool
    rollback_to: int | None
    """What a rollback puts 100% on (None: nothing to roll back to)."""
    split: str
    """The live split, e.g. ``v3 90% · v4 10%``."""
    versions: list[ReleaseVersion]
    tool_call_parser: str | None = None
    """The adapter's own tool-call parser (None: the server's)."""
    reasoning_parser: str | None = None
    """The adapter's own reasoning parser (None: the server's)."""
    chat_template_sha256: str | None = None
    """sha256 of the adapter's own chat template (None: the server's template)."""
    chat_template_chars: int | None = None


class Releases(BaseModel):
    object: Literal["list"] = "list"
    data: list[ReleaseRow]
    window_s: int = 3600
