"""Per-tenant quotas: what a tenant may use at once, per minute, and in storage.

A field left ``None`` is unlimited (the two objectives: the server's). A tenant without its own row in ``tenant_quotas``
gets the operator's defaults (``RegistryService(default_quotas=...)``). The registry
enforces ``max_adapters``, ``max_stored_bytes``, ``max_embedding_copy_bytes`` and
``max_versions_per_adapter`` at upload; the platform's limiter
(``loramux.platform.limits``) enforces the other four per request.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from loramux.registry.errors import InvalidQuota, QuotaExceeded


@dataclass(frozen=True)
class Quotas:
    """One tenant's limits. ``None`` = unlimited; every other value is an integer ≥ the
    field's minimum (1 for the per-request limits, 0 for the storage ones: 0 forbids uploads)."""

    max_concurrent_requests: int | None = field(default=None, metadata={"doc": (
        "Requests admitted and not finished (queued or running) at any moment.")})
    max_queued_sequences: int | None = field(default=None, metadata={"doc": (
        "Sequences admitted and not finished, each request counting ``max(n, best_of)``.")})
    requests_per_minute: int | None = field(default=None, metadata={"doc": (
        "Token bucket: this many requests per minute, bursts up to the same number.")})
    tokens_per_minute: int | None = field(default=None, metadata={"doc": (
        "Token bucket over prompt + generated tokens (estimated at admission, corrected after).")})
    max_adapters: int | None = field(default=None, metadata={"doc": (
        "Adapters the tenant may store.")})
    max_stored_bytes: int | None = field(default=None, metadata={"doc": (
        "Sum of the tenant's adapter weight sizes (``size_bytes``, each stored object once).")})
    max_embedding_copy_bytes: int | None = field(default=0, metadata={"doc": (
        "Bytes of one adapter's embed_tokens / lm_head rows that differ from the base model "
        "(PEFT's full copies: modules_to_save, save_embedding_layers), served as its own rows; "
        "0 (the default) refuses such adapters, null allows any size.")})
    ttft_objective_ms: int | None = field(default=None, metadata={"doc": (
        "The tenant's time-to-first-token objective in ms, in the engine's goodput count (a "
        "step gives prompts due sooner more of it); null: the server's --target-ttft-ms.")})
    itl_objective_ms: int | None = field(default=None, metadata={"doc": (
        "The tenant's mean inter-token objective in ms, in the engine's goodput count (its "
        "streams' slack); null: the server's --target-itl-ms.")})
    max_versions_per_adapter: int | None = field(default=5, metadata={"doc": (
        "Versions kept per adapter: an upload past it removes the oldest version no rollout "
        "uses (and its weights); when every older version is in use the upload is refused.")})

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None:
                continue
            low = 0 if f.name in ("max_adapters", "max_stored_bytes", "max_embedding_copy_bytes") else 1
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise InvalidQuota(
                    f"quota {f.name} must be an integer >= {low} or null (unlimited), "
                    f"got {value!r}"
                )

    def to_dict(self) -> dict[str, int | None]:
        """JSON-friendly fields for the API and the CLI."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Quotas:
        """Quotas from a mapping of field names; an unknown name raises :class:`InvalidQuota`."""
        unknown = sorted(set(data) - set(QUOTA_FIELDS))
        if unknown:
            raise InvalidQuota(
                f"unknown quota {unknown[0]!r}; known: {', '.join(QUOTA_FIELDS)}"
            )
        return cls(**dict(data))


STORAGE_QUOTAS = ("max_adapters", "max_stored_bytes", "max_embedding_copy_bytes", "max_versions_per_adapter")
"""The quotas the registry enforces (the others are the platform limiter's)."""
QUOTA_FIELDS = tuple(f.name for f in fields(Quotas))


@dataclass(frozen=True)
class TenantUsage:
    """What a tenant stores now: adapter count and the bytes of its versions' weights (an
    object several versions share counted once)."""

    adapters: int
    stored_bytes: int


def check_storage(quotas: Quotas, usage: TenantUsage, new_adapters: int, new_bytes: int) -> None:
    """Raise :class:`QuotaExceeded` if adding ``new_adapters`` adapters and ``new_bytes``
    bytes (either may be ≤ 0 for a replacement) takes ``usage`` past ``quotas``.
    Called inside the upload's transaction, with the tenant's row locked."""
    limit = quotas.max_adapters
    if limit is not None and new_adapters > 0 and usage.adapters + new_adapters > limit:
        raise QuotaExceeded("max_adapters", limit, usage.adapters, new_adapters, "adapters")
    limit = quotas.max_stored_bytes
    if limit is not None and new_bytes > 0 and usage.stored_bytes + new_bytes > limit:
        raise QuotaExceeded("max_stored_bytes", limit, usage.stored_bytes, new_bytes, "bytes")
