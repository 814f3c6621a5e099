"""The audit log of :class:`~loramux.registry.service.RegistryService` (every change to an
adapter is an event row, written in the change's own transaction) and the export, the
operation it records that is not a change to a row."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sqlalchemy import select

from loramux.registry.errors import AdapterNotFound, BaseModelNotConfigured
from loramux.registry.handles import AdapterEventInfo
from loramux.registry.models import Adapter, AdapterEvent
from loramux.registry.tenants import TenantRef

if TYPE_CHECKING:
    from loramux.registry.service import RegistryService


class AdapterAudit:
    """Mixed into :class:`~loramux.registry.service.RegistryService`."""

    @staticmethod
    def _event(
        row: Adapter, kind: str, actor: str | None, details: dict[str, Any] | None = None
    ) -> AdapterEvent:
        return AdapterEvent(
            tenant_id=row.tenant_id,
            adapter_id=row.id,
            adapter_name=row.name,
            kind=kind,
            actor=actor,
            details=details,
        )

    def record_event(
        self: RegistryService,
        adapter_id: int,
        kind: str,
        *,
        actor: str | None = None,
        details: dict[str, Any] | None = None,
    ) -> None:
        """Log an event done elsewhere (``evicted`` by the admin API, ``exported``)."""
        with self.db.session() as s:
            row = s.get(Adapter, adapter_id)
            if row is None:
                raise AdapterNotFound(f"adapter id {adapter_id} not found")
            s.add(self._event(row, kind, actor, details))
            handle = self._newest(s, [row])[0]
        self._notify(kind, handle)

    def events(
        self: RegistryService, tenant: TenantRef | None = None, *, adapter_name: str | None = None,
        limit: int = 100,
    ) -> list[AdapterEventInfo]:
        """Recent audit events, newest first."""
        with self.db.session() as s:
            q = select(AdapterEvent).order_by(AdapterEvent.id.desc()).limit(limit)
            if tenant is not None:
                q = q.where(AdapterEvent.tenant_id == self._tenant_id(s, tenant))
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

    def export(
        self: RegistryService,
        tenant: TenantRef,
        name: str,
        out: str | os.PathLike,
        *,
        base_model_path: str | os.PathLike | None = None,
        check: bool = False,
        actor: str | None = None,
        overwrite: bool = False,
        progress: bool = True,
        version: int | None = None,
    ) -> Path:
        """Merge one version of the adapter (default: the newest) into the base model and
        save a Hugging Face folder at ``out``."""
        from loramux.adapters.merge import export_merged

        base = Path(base_model_path) if base_model_path else self.base_model_path
        if base is None:
            raise BaseModelNotConfigured(
                "export needs the base model folder; pass base_model= to build_registry "
                "(or --base-model to the CLI)"
            )
        handle = self.get(tenant, name) if version is None else self.get_version(tenant, name, version)
        path = export_merged(
            base,
            handle.local_path(),
            out,
            check=check,
            max_lora_rank=max(self.max_lora_rank, handle.rank),
            overwrite=overwrite,
            progress=progress,
        )
        self.record_event(handle.id, "exported", actor=actor,
                          details={"out": str(path), "version": handle.version})
        return path
