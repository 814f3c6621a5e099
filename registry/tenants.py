"""Tenants, their API keys and their quotas (:class:`Tenants`, a part of
``RegistryService``): over the database, announcing ``key_revoked`` and ``quotas_changed``
on the registry's event bus. The other parts find a tenant through :meth:`Tenants.tenant_id`
and count its storage through :meth:`Tenants.usage_in`.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TYPE_CHECKING

from sqlalchemy import func, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, selectinload

from loramux.registry import auth
from loramux.registry.errors import TenantConflict, TenantNotFound
from loramux.registry.models import Adapter, AdapterVersion, ApiKey, Tenant, TenantQuota, utcnow
from loramux.registry.names import check_name
from loramux.registry.quotas import QUOTA_FIELDS, Quotas, TenantUsage

if TYPE_CHECKING:
    from loramux.registry.db import Database
    from loramux.registry.events import EventBus

TenantRef = Tenant | int | str
KEY_LAST_USED_EVERY = timedelta(minutes=1)
"""``ApiKey.last_used_at`` is written at most this often per key."""


@dataclass(frozen=True)
class ApiKeyInfo:
    """An API key's public facts (the key itself is never stored)."""

    tenant_id: int
    prefix: str
    label: str | None
    is_admin: bool
    created_at: datetime
    last_used_at: datetime | None
    revoked_at: datetime | None


class Tenants:
    """Tenants, API keys and quotas. ``default_quotas`` apply to every tenant without
    quotas of its own."""

    def __init__(self, db: Database, bus: EventBus, default_quotas: Quotas | None = None) -> None:
        self.db = db
        self.bus = bus
        self.default_quotas = default_quotas or Quotas()

    def create_tenant(self, name: str, *, admin: bool = False) -> tuple[Tenant, str]:
        """Create a tenant and its first API key; the plaintext key is returned only here."""
        check_name(name, "tenant")
        try:
            with self.db.session() as s:
                tenant = Tenant(name=name)
                s.add(tenant)
                s.flush()
                key = self._add_key(s, tenant.id, admin=admin, label="initial")
        except IntegrityError:
            raise TenantConflict(f"tenant {name!r} already exists; pick another name") from None
        return tenant, key

    def _add_key(self, s: Session, tenant_id: int, *, admin: bool, label: str | None) -> str:
        key, prefix = auth.generate_key()
        s.add(
            ApiKey(
                tenant_id=tenant_id,
                prefix=prefix,
                key_hash=auth.hash_key(key),
                is_admin=admin,
                label=label,
            )
        )
        return key

    def create_api_key(
        self, tenant: TenantRef, *, admin: bool = False, label: str | None = None
    ) -> str:
        """Add an API key to a tenant; returns the plaintext key (shown once)."""
        with self.db.session() as s:
            return self._add_key(s, self.tenant_id(s, tenant), admin=admin, label=label)

    def revoke_api_key(self, key_or_prefix: str) -> bool:
        """Revoke a key by its plaintext or its prefix; ``False`` if no such active key."""
        prefix = auth.key_prefix(key_or_prefix) or key_or_prefix
        with self.db.session() as s:
            row = s.scalar(select(ApiKey).where(ApiKey.prefix == prefix))
            if row is None or row.revoked_at is not None:
                return False
            row.revoked_at = utcnow()
        self.bus.notify("key_revoked", None)
        return True

    def authenticate_key(self, key: str) -> ApiKey | None:
        """The active ``ApiKey`` (with ``.tenant`` loaded) for a plaintext key, else ``None``."""
        prefix = auth.key_prefix(key)
        if prefix is None:
            auth.burn_time(key or "")
            return None
        with self.db.session() as s:
            row = s.scalar(
                select(ApiKey).options(selectinload(ApiKey.tenant)).where(ApiKey.prefix == prefix)
            )
            if row is None:
                auth.burn_time(key)
                return None
            if not auth.verify_key(key, row.key_hash) or row.revoked_at is not None:
                return None
            now = utcnow()
            if row.last_used_at is None or now - row.last_used_at > KEY_LAST_USED_EVERY:
                row.last_used_at = now  # at most one write per key and minute
            return row

    def list_api_keys(self, tenant: TenantRef | None = None) -> list[ApiKeyInfo]:
        """Every key (of one tenant, or all): prefix, label, dates; never the key."""
        with self.db.session() as s:
            q = select(ApiKey).order_by(ApiKey.id)
            if tenant is not None:
                q = q.where(ApiKey.tenant_id == self.tenant_id(s, tenant))
            return [
                ApiKeyInfo(k.tenant_id, k.prefix, k.label, bool(k.is_admin), k.created_at,
                           k.last_used_at, k.revoked_at)
                for k in s.scalars(q)
            ]

    def authenticate(self, key: str) -> Tenant | None:
        """The tenant owning an active API key, else ``None`` (constant-time hash compare)."""
        row = self.authenticate_key(key)
        return row.tenant if row is not None else None

    def get_tenant(self, tenant: TenantRef) -> Tenant:
        with self.db.session() as s:
            return s.get_one(Tenant, self.tenant_id(s, tenant))

    def list_tenants(self) -> list[Tenant]:
        with self.db.session() as s:
            return list(s.scalars(select(Tenant).order_by(Tenant.name)))

    def tenant_id(self, s: Session, tenant: TenantRef) -> int:
        """The id of a tenant given as a row, an id or a name, in the caller's session
        (:class:`TenantNotFound` if there is none)."""
        if isinstance(tenant, Tenant):
            tenant = tenant.id
        if isinstance(tenant, int) and not isinstance(tenant, bool):
            found = s.scalar(select(Tenant.id).where(Tenant.id == tenant))
        elif isinstance(tenant, str):
            found = s.scalar(select(Tenant.id).where(Tenant.name == tenant))
        else:
            raise TypeError(f"tenant must be a Tenant, an id or a name, not {type(tenant)!r}")
        if found is None:
            raise TenantNotFound(
                f"tenant {tenant!r} not found; create it with `loramux tenants create NAME`"
            )
        return found

    # -- quotas ---------------------------------------------------------------------

    def get_quotas(self, tenant: TenantRef) -> Quotas:
        """The tenant's quotas in effect: its own, else the operator's defaults. Called by
        the platform per request (cache it briefly) and by the API/CLI to show them."""
        with self.db.session() as s:
            row = s.get(TenantQuota, self.tenant_id(s, tenant))
            if row is None:
                return self.default_quotas
            return Quotas(**{name: getattr(row, name) for name in QUOTA_FIELDS})

    def set_quotas(self, tenant: TenantRef, quotas: Quotas | None) -> Quotas:
        """Give the tenant its own quotas (every field; ``None`` fields are unlimited), or
        with ``quotas=None`` drop them so the defaults apply again. Returns the quotas in
        effect; listeners hear ``quotas_changed``. Lowering a storage quota below the current
        usage deletes nothing; it only refuses further uploads."""
        with self.db.session() as s:
            tenant_id = self.tenant_id(s, tenant)
            row = s.get(TenantQuota, tenant_id)
            if quotas is None:
                if row is not None:
                    s.delete(row)
            else:
                if row is None:
                    row = TenantQuota(tenant_id=tenant_id)
                    s.add(row)
                for name in QUOTA_FIELDS:
                    setattr(row, name, getattr(quotas, name))
                row.updated_at = utcnow()
        self.bus.notify("quotas_changed", None)
        return self.default_quotas if quotas is None else quotas

    def get_usage(self, tenant: TenantRef) -> TenantUsage:
        """What the tenant stores now (adapter count, bytes of its versions' weights)."""
        with self.db.session() as s:
            return self.usage_in(s, self.tenant_id(s, tenant))

    @staticmethod
    def usage_in(s: Session, tenant_id: int) -> TenantUsage:
        """What the tenant stores, counted in the caller's session (an upload's checks)."""
        count = s.scalar(select(func.count(Adapter.id)).where(Adapter.tenant_id == tenant_id))
        objects = (select(AdapterVersion.object_key, AdapterVersion.size_bytes)
                   .join(Adapter, Adapter.id == AdapterVersion.adapter_id)
                   .where(Adapter.tenant_id == tenant_id).distinct().subquery())
        total = s.scalar(select(func.coalesce(func.sum(objects.c.size_bytes), 0)))
        return TenantUsage(int(count or 0), int(total or 0))
