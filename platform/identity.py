"""Who sent a request (:class:`Caller`) and the engine's name of one adapter version
(:class:`EngineKey`).

Both travel through the whole platform: authentication makes the caller, the resolver,
the request gate, the admin API and the cluster roles read it; the resolver names every
adapter version it hands the engine with an engine key, which the engine, the metrics,
the dashboard and the cluster's heartbeats and events carry as its string.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from loramux.registry.handles import AdapterHandle


class TenantLike(Protocol):
    """What the platform reads of a tenant (the registry's row, or a test's stand-in)."""

    id: int
    name: str


@dataclass(frozen=True)
class Caller:
    """Who sent a request: a tenant, or nobody (anonymous access to shared models)."""

    tenant: TenantLike | None = None
    is_admin: bool = False
    key_prefix: str | None = None
    """The public prefix of the API key used (usage records, sticky rollouts); None for
    the operator's admin key and anonymous callers."""

    @property
    def tenant_id(self) -> int | None:
        return self.tenant.id if self.tenant is not None else None


STATIC_OWNER = "static"
"""The owner of the ``--lora-modules`` adapters (every caller may use them)."""
DIGEST_CHARS = 12
"""Hex characters of the content digest an engine key keeps."""


@dataclass(frozen=True)
class EngineKey:
    """The engine's name of one version of an adapter: ``"<owner>/<name>@<digest>"``.

    Unique across tenants (``owner`` is the tenant's id, or ``static``) and versions
    (``digest``: the first :data:`DIGEST_CHARS` hex characters of the content digest), so
    a replaced adapter never serves stale weights nor shares a KV block with its old
    version. ``str(key)`` is what the engine, metrics and the cluster carry;
    :meth:`parse` reads one back."""

    owner: str
    name: str
    digest: str

    def __post_init__(self) -> None:
        if not self.owner or "/" in self.owner:
            raise ValueError(f"an engine key's owner must be non-empty without '/': {self.owner!r}")
        if not self.name:
            raise ValueError("an engine key needs an adapter name")
        if not self.digest or "@" in self.digest:
            raise ValueError(f"an engine key's digest must be non-empty without '@': {self.digest!r}")

    @classmethod
    def of(cls, owner: int | str, name: str, digest: str) -> EngineKey:
        """The key of ``name`` owned by ``owner`` (a tenant id or ``static``) whose content
        has ``digest`` (the full digest; the key keeps its first characters)."""
        return cls(str(owner), name, digest[:DIGEST_CHARS])

    @classmethod
    def for_handle(cls, handle: AdapterHandle) -> EngineKey:
        """The key of a registry adapter version."""
        return cls.of(handle.tenant_id, handle.name, handle.cache_key)

    @classmethod
    def parse(cls, text: str) -> EngineKey:
        """The key ``str(key)`` wrote; ValueError for anything else."""
        owner, slash, rest = text.partition("/")
        name, at, digest = rest.rpartition("@")
        if not slash or not at:
            raise ValueError(f"not an engine key (owner/name@digest): {text!r}")
        return cls(owner, name, digest)

    @property
    def tenant_id(self) -> int | None:
        """The owning tenant's id; None for a static adapter."""
        return int(self.owner) if self.owner.isdigit() else None

    def __str__(self) -> str:
        return f"{self.owner}/{self.name}@{self.digest}"
