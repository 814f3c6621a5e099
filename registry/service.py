"""``RegistryService``: adapters over SQL + an object store, one facade over its parts.

The parts, each given what it uses: :class:`~.tenants.Tenants` (tenants, keys, quotas),
:class:`~.audit.AdapterAudit` (the audit events), :class:`~.versions.AdapterReleases`
(``adapters``: handles, listings, versions, rollouts, retention),
:class:`~.uploads.Uploads` (validate → store → commit), the :class:`~.events.EventBus`
every part announces its committed changes on, and the :class:`~.gc.Storage` (database,
object store, disk cache, scratch folder) gc works over. The service itself does what
spans them: deleting an adapter, its preset, description and chat settings, the outside
events it logs, the export and gc. Every public method of the parts is reached through the
service (the platform and the CLI hold one ``RegistryService``); no part calls another's
private methods.

Every adapter query is scoped to one tenant: another tenant's adapter is reported exactly
like a missing one.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from loramux.adapters.archive import CONFIG_NAME
from loramux.adapters.format import DEFAULT_MAX_ADAPTER_BYTES
from loramux.adapters.spec import DEFAULT_MAX_LORA_RANK
from loramux.registry.audit import AdapterAudit
from loramux.registry.cache import AdapterCache
from loramux.registry.chat import audit_details, check_chat
from loramux.registry.db import Database
from loramux.registry.errors import (
    AdapterNotFound,
    BaseModelNotConfigured,
    InvalidDescription,
)
from loramux.registry.events import EventBus
from loramux.registry.gc import (
    DEFAULT_GC_MIN_AGE_S,
    LEFTOVER_AGE_S,
    OBJECT_PREFIX,
    GcReport,
    Storage,
    collect,
    remove_leftovers,
)
from loramux.registry.handles import AdapterHandle
from loramux.registry.models import (
    MAX_DESCRIPTION_CHARS,
    Adapter,
    utcnow,
)
from loramux.registry.presets import PresetCheck, check_preset
from loramux.registry.quotas import Quotas
from loramux.registry.store import ObjectStore
from loramux.registry.stored_responses import StoredResponses
from loramux.registry.tenants import TenantRef, Tenants
from loramux.registry.uploads import UploadChecks, Uploads
from loramux.registry.usage import UsageLedger
from loramux.registry.versions import AdapterReleases


class _Part:
    """A public method (or attribute) of one of the service's parts, reached through the
    service (``create_tenant = _Part("tenants")`` is ``service.tenants.create_tenant``)."""

    def __init__(self, part: str) -> None:
        self.part = part

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, obj: Any, objtype: type | None = None) -> Any:
        if obj is None:
            return self
        return getattr(getattr(obj, self.part), self.name)


class RegistryService:
    """Tenants, API keys and adapters. Thread-safe; one per process.

    ``base_config`` (a ``config.json`` dict or ``PretrainedConfig``) and
    ``base_model_name`` describe the served base model; uploads are validated
    against them. ``base_model_path`` (a Hugging Face folder) is needed for export.
    ``default_quotas`` apply to every tenant without quotas of its own (default: unlimited).
    """

    def __init__(
        self,
        db: Database,
        store: ObjectStore,
        cache: AdapterCache,
        *,
        base_config: Mapping[str, Any] | Any | None = None,
        base_model_name: str | None = None,
        base_model_path: str | os.PathLike | None = None,
        max_lora_rank: int = DEFAULT_MAX_LORA_RANK,
        max_adapter_bytes: int = DEFAULT_MAX_ADAPTER_BYTES,
        tmp_dir: str | os.PathLike | None = None,
        preset_check: PresetCheck | None = None,
        default_quotas: Quotas | None = None,
    ) -> None:
        self.db = db
        self.store = store
        self.cache = cache
        self.base_model_path = Path(base_model_path) if base_model_path else None
        self.tmp_dir = Path(tmp_dir) if tmp_dir else None
        if self.tmp_dir:
            self.tmp_dir.mkdir(parents=True, exist_ok=True)
        self.storage = Storage(db, store, cache, self.tmp_dir)
        self.bus = EventBus()
        self.tenants = Tenants(db, self.bus, default_quotas)
        self.audit = AdapterAudit(db, self.tenants)
        self.adapters = AdapterReleases(self.storage, self.tenants, self.audit, self.bus)
        self.checks = UploadChecks(base_config, base_model_name, max_lora_rank,
                                   max_adapter_bytes, preset_check, base_model_path)
        """What an upload is checked against (the served base model, the serving limits)."""
        self.uploads = Uploads(self.storage, self.tenants, self.adapters, self.audit, self.bus,
                               self.checks)
        self.usage = UsageLedger(db)
        """Finished requests' usage records (appended by the platform's usage writer)."""
        self.stored_responses = StoredResponses(db)
        """Stored Responses API responses (``store: true``), per tenant."""

    @property
    def default_quotas(self) -> Quotas:
        """The quotas of tenants without their own (the operator may change them)."""
        return self.tenants.default_quotas

    @default_quotas.setter
    def default_quotas(self, quotas: Quotas) -> None:
        self.tenants.default_quotas = quotas

    # -- events: ``subscribe(listener)`` calls ``listener(kind, handle)`` after each
    # committed change (uploaded, version_added, version_removed, rollout_changed,
    # rolled_back, deleted, preset_changed, described, chat_changed, evicted, exported;
    # ``key_revoked`` and ``quotas_changed`` with handle None) and returns the unsubscribe
    # function.
    subscribe = _Part("bus")
    unsubscribe = _Part("bus")

    # -- tenants, keys and quotas (tenants.py)
    create_tenant = _Part("tenants")
    create_api_key = _Part("tenants")
    revoke_api_key = _Part("tenants")
    authenticate_key = _Part("tenants")
    authenticate = _Part("tenants")
    list_api_keys = _Part("tenants")
    get_tenant = _Part("tenants")
    list_tenants = _Part("tenants")
    get_quotas = _Part("tenants")
    set_quotas = _Part("tenants")
    get_usage = _Part("tenants")

    # -- stored Responses API responses (stored_responses.py)
    store_response = _Part("stored_responses")
    get_stored_response = _Part("stored_responses")
    delete_stored_response = _Part("stored_responses")
    stored_response_usage = _Part("stored_responses")

    # -- the audit log (audit.py)
    events = _Part("audit")

    # -- reading adapters, versions and rollouts (versions.py)
    cached_path = _Part("adapters")
    list = _Part("adapters")
    list_all = _Part("adapters")
    get = _Part("adapters")
    get_by_id = _Part("adapters")
    fetch_by_id = _Part("adapters")
    release = _Part("adapters")
    resolve = _Part("adapters")
    get_version = _Part("adapters")
    list_all_versions = _Part("adapters")
    releases = _Part("adapters")
    set_rollout = _Part("adapters")
    follow_latest = _Part("adapters")
    rollback = _Part("adapters")
    delete_version = _Part("adapters")

    # -- uploads (uploads.py) and what they are checked against
    validate = _Part("uploads")
    upload = _Part("uploads")
    base_config = _Part("checks")
    base_model_name = _Part("checks")
    max_lora_rank = _Part("checks")
    max_adapter_bytes = _Part("checks")
    preset_check = _Part("checks")

    # -- adapter changes that span the parts ------------------------------------------
    def delete(self, tenant: TenantRef, name: str, *, actor: str | None = None) -> AdapterHandle:
        """Remove the adapter and every version (the name becomes free); the weights go at
        the next ``gc()``. Listeners hear ``deleted`` with the newest version's handle."""
        with self.db.session() as s:
            row = self.adapters.row(s, self.tenants.tenant_id(s, tenant), name)
            handle = self.adapters.newest(s, [row])[0]
            versions = [v.number for v in self.adapters.versions(s, row.id)]
            s.add(self.audit.event(row, "deleted", actor, {"version": row.last_version,
                                                           "versions": versions}))
            s.delete(row)
        self.bus.notify("deleted", handle)
        return handle

    def _change(self, tenant: TenantRef, name: str, kind: str, actor: str | None,
                details: dict[str, Any] | None, **values: Any) -> AdapterHandle:
        with self.db.session() as s:
            row = self.adapters.row(s, self.tenants.tenant_id(s, tenant), name)
            for k, v in values.items():
                setattr(row, k, v)
            row.updated_at = utcnow()
            s.add(self.audit.event(row, kind, actor, details))
            s.flush()
            handle = self.adapters.newest(s, [row])[0]
        self.bus.notify(kind, handle)
        return handle

    def set_preset(
        self,
        tenant: TenantRef,
        name: str,
        preset: dict[str, Any] | None,
        *,
        actor: str | None = None,
    ) -> AdapterHandle:
        """Store (or with ``None`` clear) the adapter's default sampling preset (every
        version shares it)."""
        checked = check_preset(preset, self.checks.preset_check)
        return self._change(tenant, name, "preset_changed", actor, {"preset": checked},
                            default_preset=checked)

    def set_description(
        self, tenant: TenantRef, name: str, description: str | None, *, actor: str | None = None
    ) -> AdapterHandle:
        """Store (or with ``None`` clear) the adapter's description."""
        if description is not None and len(description) > MAX_DESCRIPTION_CHARS:
            raise InvalidDescription(
                f"a description may hold at most {MAX_DESCRIPTION_CHARS} characters, "
                f"got {len(description)}"
            )
        return self._change(tenant, name, "described", actor, None,
                            description=description or None)

    def set_chat(self, tenant: TenantRef, name: str, *, actor: str | None = None,
                 **changes: str | None) -> AdapterHandle:
        """Change the adapter's chat settings (every version shares them): any of
        ``chat_template``, ``tool_call_parser``, ``reasoning_parser``; ``None`` clears one
        back to the server's. Only the stored shape is checked here (the platform checks
        first that the template renders and the parsers work). Listeners hear
        ``chat_changed``; the audit keeps the template's digest, never its text."""
        values = check_chat(changes)
        if not values:
            return self.get(tenant, name)
        return self._change(tenant, name, "chat_changed", actor, audit_details(values),
                            **values)

    # -- events done elsewhere, and the export ------------------------------------------
    def record_event(self, adapter_id: int, kind: str, *, actor: str | None = None,
                     details: dict[str, Any] | None = None) -> None:
        """Log an event done elsewhere (``evicted`` by the admin API, ``exported``, an
        adapter found ``broken`` while serving); listeners hear it."""
        with self.db.session() as s:
            row = s.get(Adapter, adapter_id)
            if row is None:
                raise AdapterNotFound(f"adapter id {adapter_id} not found")
            s.add(self.audit.event(row, kind, actor, details))
            handle = self.adapters.newest(s, [row])[0]
        self.bus.notify(kind, handle)

    def export(self, tenant: TenantRef, name: str, out: str | os.PathLike, *,
               base_model_path: str | os.PathLike | None = None, check: bool = False,
               actor: str | None = None, overwrite: bool = False, progress: bool = True,
               version: int | None = None) -> Path:
        """Merge one version of the adapter (default: the newest) into the base model and
        save a Hugging Face folder at ``out`` (logged as ``exported``)."""
        from loramux.adapters.merge import export_merged

        base = Path(base_model_path) if base_model_path else self.base_model_path
        if base is None:
            raise BaseModelNotConfigured(
                "export needs the base model folder; pass base_model= to build_registry "
                "(or --base-model to the CLI)"
            )
        handle = self.get(tenant, name) if version is None else self.get_version(tenant, name, version)
        path = export_merged(base, handle.local_path(), out, check=check,
                             max_lora_rank=max(self.checks.max_lora_rank, handle.rank),
                             overwrite=overwrite, progress=progress)
        self.record_event(handle.id, "exported", actor=actor,
                          details={"out": str(path), "version": handle.version})
        return path

    # -- garbage collection ---------------------------------------------------------
    def gc(self, *, min_age_seconds: float = DEFAULT_GC_MIN_AGE_S,
           leftover_age_s: float = LEFTOVER_AGE_S) -> GcReport:
        """Delete stored objects no row references and no upload in progress marks (after
        ``min_age_seconds``), stale pending markers and crash leftovers (older than
        ``leftover_age_s``), and prune cache entries of adapters that no longer exist."""
        return collect(self.storage, min_age_seconds=min_age_seconds,
                       leftover_age_s=leftover_age_s)

    def remove_leftovers(self, min_age_s: float = LEFTOVER_AGE_S) -> list[str]:
        """Remove what a killed process left (scratch folders, temporary pieces)."""
        return remove_leftovers(self.storage, min_age_s)


__all__ = ["CONFIG_NAME", "OBJECT_PREFIX", "GcReport", "RegistryService"]
