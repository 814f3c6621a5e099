"""SQLAlchemy 2.0 models of the registry. The schema is created by Alembic (``migrations/``),
never by ``create_all`` outside tests; a test checks that models and migrations agree."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship
from sqlalchemy.types import TypeDecorator

NAMING_CONVENTION = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

ADAPTER_STATUSES = ("ready", "disabled")
EVENT_KINDS = ("uploaded", "version_added", "version_removed", "rollout_changed", "rolled_back",
               "deleted", "evicted", "exported", "preset_changed", "chat_changed")


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


class UTCDateTime(TypeDecorator):
    """A timezone-aware UTC datetime on every backend (SQLite hands back naive values)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Any) -> datetime | None:
        if value is not None and value.tzinfo is None:
            value = value.replace(tzinfo=timezone.utc)
        return value.astimezone(timezone.utc) if value is not None else None

    def process_result_value(self, value: datetime | None, dialect: Any) -> datetime | None:
        if value is not None and value.tzinfo is None:
            value = value.replace(tzinfo=timezone.utc)
        return value


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)
    type_annotation_map = {datetime: UTCDateTime(), dict[str, Any]: JSON(), list[str]: JSON()}


class Tenant(Base):
    """A customer: owns API keys and adapters."""

    __tablename__ = "tenants"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(128), unique=True)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)

    api_keys: Mapped[list[ApiKey]] = relationship(
        back_populates="tenant", cascade="all, delete-orphan", passive_deletes=True
    )
    adapters: Mapped[list[Adapter]] = relationship(
        back_populates="tenant", cascade="all, delete-orphan", passive_deletes=True
    )


class ApiKey(Base):
    """An API key. Only a short lookup prefix and a salted hash are stored, never the key.

    ``is_admin`` keys may use the admin API (evict, pin, export any tenant's adapter).
    """

    __tablename__ = "api_keys"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    prefix: Mapped[str] = mapped_column(String(16), unique=True)
    key_hash: Mapped[str] = mapped_column(String(256))
    is_admin: Mapped[bool] = mapped_column(default=False)
    label: Mapped[str | None] = mapped_column(String(128))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    last_used_at: Mapped[datetime | None]
    revoked_at: Mapped[datetime | None]

    tenant: Mapped[Tenant] = relationship(back_populates="api_keys")


MAX_DESCRIPTION_CHARS = 2000


class Adapter(Base):
    """One tenant's adapter name: its immutable versions (:class:`AdapterVersion`), the
    rollout that spreads requests for the plain name over them, and what every version
    shares (default preset, description, status)."""

    __tablename__ = "adapters"
    __table_args__ = (UniqueConstraint("tenant_id", "name"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    name: Mapped[str] = mapped_column(String(128))
    last_version: Mapped[int] = mapped_column(default=0)
    """The highest version number ever given (numbers are never reused)."""
    status: Mapped[str] = mapped_column(String(16), default="ready")
    default_preset: Mapped[dict[str, Any] | None]
    description: Mapped[str | None] = mapped_column(String(MAX_DESCRIPTION_CHARS), default=None)
    """The tenant's free-text note on the adapter."""
    rollout_weights: Mapped[dict[str, Any] | None]
    """``{"<version>": percent, ...}`` summing to 100; NULL = the newest version takes every
    request (and each upload moves there)."""
    rollout_sticky: Mapped[str] = mapped_column(String(8), default="user")
    """What keeps one caller on one version: ``user``, ``key`` or ``none``."""
    previous_live: Mapped[int | None]
    """The version that alone took every request before the rollout now in effect (the
    target of a rollback); NULL when there is none."""
    chat_template: Mapped[str | None] = mapped_column(Text, default=None)
    """The adapter's own Jinja chat template (shipped as ``chat_template.jinja`` or in
    ``tokenizer_config.json``, or set with PATCH); NULL = the base model's. Rendered
    sandboxed, with a time and size bound."""
    tool_call_parser: Mapped[str | None] = mapped_column(String(64), default=None)
    """``--tool-call-parser`` name for this adapter's requests; NULL = the server's."""
    reasoning_parser: Mapped[str | None] = mapped_column(String(64), default=None)
    """``--reasoning-parser`` name for this adapter's requests; NULL = the server's."""
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow, onupdate=utcnow)

    tenant: Mapped[Tenant] = relationship(back_populates="adapters")
    versions: Mapped[list[AdapterVersion]] = relationship(
        back_populates="adapter", cascade="all, delete-orphan", passive_deletes=True,
        order_by="AdapterVersion.number",
    )


class AdapterVersion(Base):
    """One immutable version of an adapter. The weights live in the object store under
    ``object_key`` (content-addressed by ``sha256``); the normalized ``adapter_config.json``
    lives in ``config``."""

    __tablename__ = "adapter_versions"
    __table_args__ = (UniqueConstraint("adapter_id", "number"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    adapter_id: Mapped[int] = mapped_column(ForeignKey("adapters.id", ondelete="CASCADE"))
    number: Mapped[int]
    base_model: Mapped[str] = mapped_column(String(256))
    rank: Mapped[int]
    alpha: Mapped[float] = mapped_column(Float)
    target_modules: Mapped[list[str]]
    config: Mapped[dict[str, Any]]
    sha256: Mapped[str] = mapped_column(String(64), index=True)
    size_bytes: Mapped[int] = mapped_column(BigInteger)
    object_key: Mapped[str] = mapped_column(String(512), index=True)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)

    adapter: Mapped[Adapter] = relationship(back_populates="versions")


class AdapterEvent(Base):
    """Audit trail: what happened to which adapter, by whom, when. Outlives the adapter."""

    __tablename__ = "adapter_events"
    __table_args__ = (Index(None, "tenant_id", "created_at"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    tenant_id: Mapped[int | None] = mapped_column(ForeignKey("tenants.id", ondelete="SET NULL"))
    adapter_id: Mapped[int | None] = mapped_column(Integer, index=True)
    adapter_name: Mapped[str] = mapped_column(String(128))
    kind: Mapped[str] = mapped_column(String(16))
    actor: Mapped[str | None] = mapped_column(String(128))
    details: Mapped[dict[str, Any] | None]
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class TenantQuota(Base):
    """A tenant's own quotas (see ``loramux.registry.quotas.Quotas``; NULL = unlimited).
    A tenant without a row gets the operator's defaults."""

    __tablename__ = "tenant_quotas"

    tenant_id: Mapped[int] = mapped_column(
        ForeignKey("tenants.id", ondelete="CASCADE"), primary_key=True
    )
    max_concurrent_requests: Mapped[int | None]
    max_queued_sequences: Mapped[int | None]
    requests_per_minute: Mapped[int | None]
    tokens_per_minute: Mapped[int | None] = mapped_column(BigInteger)
    max_adapters: Mapped[int | None]
    max_stored_bytes: Mapped[int | None] = mapped_column(BigInteger)
    max_versions_per_adapter: Mapped[int | None]
    max_embedding_copy_bytes: Mapped[int | None] = mapped_column(BigInteger)
    ttft_objective_ms: Mapped[int | None]
    itl_objective_ms: Mapped[int | None]
    updated_at: Mapped[datetime] = mapped_column(default=utcnow, onupdate=utcnow)


class UsageRecord(Base):
    """One finished inference request, for billing and per-version numbers. Written in
    batches off the request path (``loramux.platform.usage``); ``request_id`` is unique, so a
    batch replayed after a database outage is never counted twice. ``tenant_id`` carries
    no foreign key: records outlive their tenant, and a batch never fails on one."""

    __tablename__ = "usage_records"
    __table_args__ = (
        Index(None, "tenant_id", "created_at"),
        Index(None, "tenant_id", "adapter", "version", "created_at"),
        Index(None, "created_at"),
    )

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True)
    request_id: Mapped[str] = mapped_column(String(80), unique=True)
    tenant_id: Mapped[int | None]
    key_prefix: Mapped[str | None] = mapped_column(String(16))
    """The API key's public prefix (never the key)."""
    adapter: Mapped[str | None] = mapped_column(String(128))
    """The adapter's name; NULL = the base model."""
    version: Mapped[int | None]
    """The version that served (NULL: the base model or a static adapter)."""
    endpoint: Mapped[str] = mapped_column(String(16))
    prompt_tokens: Mapped[int] = mapped_column(default=0)
    cached_tokens: Mapped[int] = mapped_column(default=0)
    completion_tokens: Mapped[int] = mapped_column(default=0)
    finish_reason: Mapped[str | None] = mapped_column(String(32))
    error: Mapped[str | None] = mapped_column(String(64))
    """Why the request failed (an error code, ``cancelled``); NULL when it finished."""
    duration_ms: Mapped[float] = mapped_column(Float, default=0.0)
    ttft_ms: Mapped[float | None] = mapped_column(Float)
    tpot_ms: Mapped[float | None] = mapped_column(Float)
    day: Mapped[str] = mapped_column(String(10))
    """``YYYY-MM-DD`` (UTC) of ``created_at``: the ``group_by=day`` key on every backend."""
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    """When the request finished."""


class StoredResponse(Base):
    """One stored Responses API response (``store: true``), readable only by its tenant.
    ``body`` is the response object as returned; ``conversation`` the chat messages it
    continued plus its own output, so ``previous_response_id`` can pick the thread up."""

    __tablename__ = "stored_responses"
    __table_args__ = (Index(None, "tenant_id", "created_at"),)

    id: Mapped[str] = mapped_column(String(80), primary_key=True)
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    model: Mapped[str] = mapped_column(String(256))
    previous_response_id: Mapped[str | None] = mapped_column(String(80))
    body: Mapped[dict[str, Any]]
    conversation: Mapped[dict[str, Any]]
    """``{"messages": [...]}``: the chat messages up to and including this response's output."""
    size_bytes: Mapped[int] = mapped_column(BigInteger, default=0)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
