"""The audit log (:class:`AdapterAudit`, a part of ``RegistryService``): every change to an
adapter is an event row, written by the part that makes the change in the change's own
transaction (:meth:`AdapterAudit.event`), and read back newest first (:meth:`AdapterAudit.events`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from sqlalchemy import select

from loramux.registry.handles import AdapterEventInfo
from loramux.registry.models import Adapter, AdapterEvent
from loramux.registry.tenants import TenantRef

if TYPE_CHECKING:
    from loramux.registry.db import Database
    from loramux.registry.tenants import Tenants


class AdapterAudit:
    """The adapters' audit events over the database (``tenants`` scopes a listing)."""

    def __init__(self, db: Database, tenants: Tenants) -> None:
        self.db = db
        self.tenants = tenants

    @staticmethod
    def event(
        row: Adapter, kind: str, actor: str | None, details: dict[str, Any] | None = None
    ) -> AdapterEvent:
        """The event row of a change to ``row`` (the caller adds it to its transaction)."""
        return AdapterEvent(
            tenant_id=row.tenant_id,
            adapter_id=row.id,
            adapter_name=row.name,
            kind=kind,
            actor=actor,
            details=details,
        )

    def events(
        self, tenant: TenantRef | None = None, *, adapter_name: str | None = None,
        limit: int = 100,
    ) -> list[AdapterEventInfo]:
        """Recent audit events, newest first."""
        with self.db.session() as s:
            q = select(AdapterEvent).order_by(AdapterEvent.id.desc()).limit(limit)
            if tenant is not None:
                q = q.where(AdapterEvent.tenant_id == self.tenants.tenant_id(s, tenant))
            if adapter_name is not None:
                q = q.where(AdapterEvent.adapter_name == adapter_name)
            return [
                AdapterEventInfo(
                    e.id,
                    e.tenant_id,
                    e.adapter_id,
                    e.adapter_name,
                    e.kind,
                    e.actor,
                    e.details,
                    e.created_at,
                )  # fmt: skip
                for e in s.scalars(q)
            ]
