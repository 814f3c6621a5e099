"""``RegistryService``: adapters over SQL + an object store (tenants, keys and quotas: tenants.py).

Upload is validate → write the weights to the store under a content-addressed key →
commit the row (and its audit event) in one transaction. A failure at any point leaves
no row; an object written by a failed upload is unreferenced and ``gc()`` removes it.
Every adapter query is scoped to one tenant: another tenant's adapter is reported
exactly like a missing one.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from loramux.adapters.archive import CONFIG_NAME, WEIGHTS_NAME, adapter_folder
from loramux.adapters.format import DEFAULT_MAX_ADAPTER_BYTES, LoraWeights, validate_adapter
from loramux.adapters.spec import DEFAULT_MAX_LORA_RANK, MAX_CONFIG_BYTES
from loramux.registry.audit import AdapterAudit
from loramux.registry.cache import AdapterCache
from loramux.registry.db import Database
from loramux.registry.errors import (
    AdapterConflict,
    AdapterNotFound,
    BaseModelNotConfigured,
    InvalidDescription,
)
from loramux.registry.gc import (
    DEFAULT_GC_MIN_AGE_S,
    LEFTOVER_AGE_S,
    OBJECT_PREFIX,
    GcReport,
    collect,
    pending_marker,
    remove_leftovers,
)
from loramux.registry.handles import AdapterHandle, Listener, object_key
from loramux.registry.models import (
    MAX_DESCRIPTION_CHARS,
    Adapter,
    Tenant,
    utcnow,
)
from loramux.registry.names import check_name
from loramux.registry.presets import PresetCheck, check_preset
from loramux.registry.quotas import Quotas, check_storage
from loramux.registry.store import ObjectStore, sha256_file
from loramux.registry.tenants import TenantAccounts, TenantRef

logger = logging.getLogger(__name__)


class RegistryService(TenantAccounts, AdapterAudit):
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
        self.base_config = base_config
        self.base_model_name = base_model_name
        self.base_model_path = Path(base_model_path) if base_model_path else None
        self.max_lora_rank = max_lora_rank
        self.max_adapter_bytes = max_adapter_bytes
        self.preset_check = preset_check
        """The serving side's preset validator (None: only the stored shape is checked)."""
        self.tmp_dir = Path(tmp_dir) if tmp_dir else None
        if self.tmp_dir:
            self.tmp_dir.mkdir(parents=True, exist_ok=True)
        self._listeners: list[Listener] = []
        self.default_quotas = default_quotas or Quotas()

    # -- events ---------------------------------------------------------------------

    def subscribe(self, listener: Listener) -> Callable[[], None]:
        """Call ``listener(kind, handle)`` after each committed change (uploaded, replaced,
        deleted, preset_changed, described, evicted, exported; ``key_revoked``
        with handle None); the platform relays it to engines and caches. Returns the
        function that unsubscribes it."""
        self._listeners.append(listener)
        return lambda: self.unsubscribe(listener)

    def unsubscribe(self, listener: Listener) -> None:
        """Stop calling ``listener`` (no error when it was not subscribed)."""
        if listener in self._listeners:
            self._listeners.remove(listener)

    def _notify(self, kind: str, handle: AdapterHandle | None) -> None:
        for listener in list(self._listeners):
            try:
                listener(kind, handle)
            except Exception:  # a listener must not undo a committed change
                logger.exception("registry event listener failed for %s", kind)

    # -- tenants and keys -----------------------------------------------------------

    def _handle(self, row: Adapter) -> AdapterHandle:
        return AdapterHandle(
            id=row.id,
            tenant_id=row.tenant_id,
            name=row.name,
            version=row.version,
            base_model=row.base_model,
            rank=row.rank,
            alpha=row.alpha,
            target_modules=tuple(row.target_modules),
            sha256=row.sha256,
            size_bytes=row.size_bytes,
            object_key=row.object_key,
            status=row.status,
            default_preset=row.default_preset,
            config=dict(row.config),
            description=row.description,
            created_at=row.created_at,
            updated_at=row.updated_at,
            _fetch=self._fetch,
        )

    def _fetch(self, handle: AdapterHandle) -> Path:
        return self.cache.fetch(self.store, handle.object_key, handle.sha256, handle.config)

    def cached_path(self, handle: AdapterHandle) -> Path | None:
        """The adapter's local folder when the disk cache holds it (no store call), else None."""
        return self.cache.lookup(handle.sha256, handle.config)

    def _row(self, s: Session, tenant_id: int, name: str) -> Adapter:
        row = s.scalar(select(Adapter).where(Adapter.tenant_id == tenant_id, Adapter.name == name))
        if row is None:
            raise AdapterNotFound(
                f"adapter {name!r} not found; list yours with GET /v1/adapters or "
                "`loramux adapters list`"
            )
        return row

    def _require_base(self) -> None:
        if self.base_config is None:
            raise BaseModelNotConfigured(
                "no base model is configured; pass base_model= to build_registry "
                "(or --base-model to the CLI)"
            )

    def validate(self, source: str | os.PathLike) -> LoraWeights:
        """Run the upload checks on an adapter folder or archive without storing anything."""
        self._require_base()
        return validate_adapter(
            source,
            self.base_config,
            max_lora_rank=self.max_lora_rank,
            max_bytes=self.max_adapter_bytes,
            base_model_name=self.base_model_name,
        )

    def upload(
        self,
        tenant: TenantRef,
        name: str,
        source: str | os.PathLike,
        *,
        actor: str | None = None,
        replace: bool = False,
        default_preset: dict[str, Any] | None = None,
    ) -> AdapterHandle:
        """Validate an adapter folder or archive and register it as ``name``.

        Raises AdapterValidationError (bad adapter), InvalidName, InvalidPreset,
        TenantNotFound, QuotaExceeded (``max_adapters``/``max_stored_bytes``), AdapterConflict (name taken, unless ``replace=True``, which
        bumps the version), ObjectStoreError.
        """
        check_name(name)
        preset = check_preset(default_preset, self.preset_check)
        self._require_base()
        with self.db.session() as s:
            tenant_id = self._tenant_id(s, tenant)
            taken = s.scalar(
                select(Adapter.id).where(Adapter.tenant_id == tenant_id, Adapter.name == name)
            )
        if taken is not None and not replace:
            raise self._conflict(name)
        if taken is None:  # fail fast before validating; checked again at commit
            check_storage(self.get_quotas(tenant_id), self.get_usage(tenant_id), 1, 0)
        with adapter_folder(
            source, max_bytes=self.max_adapter_bytes + MAX_CONFIG_BYTES, tmp_dir=self.tmp_dir
        ) as folder:
            weights = self.validate(folder)
            spec = weights.spec
            del weights
            weights_path = folder / WEIGHTS_NAME
            digest = sha256_file(weights_path)
            fields = dict(
                base_model=self.base_model_name or "unknown",
                rank=spec.r,
                alpha=spec.lora_alpha,
                target_modules=list(spec.target_modules),
                config=spec.to_config(),
                sha256=digest,
                size_bytes=weights_path.stat().st_size,
                object_key=object_key(digest),
                status="ready",
            )
            if preset is not None:
                fields["default_preset"] = preset
            # the marker keeps gc() off the object until the row is committed (or not)
            with pending_marker(self.store, digest, self.tmp_dir):
                # Always (re)write: it refreshes the object's age too.
                self.store.put_file(fields["object_key"], weights_path, sha256=digest)
                handle, kind = self._commit_upload(tenant_id, name, fields, actor, replace)
        self._notify(kind, handle)
        return handle

    @staticmethod
    def _conflict(name: str) -> AdapterConflict:
        return AdapterConflict(
            f"adapter {name!r} already exists; delete it first, pick another name, or "
            "upload with replace"
        )

    def _commit_upload(
        self,
        tenant_id: int,
        name: str,
        fields: dict[str, Any],
        actor: str | None,
        replace: bool,
    ) -> tuple[AdapterHandle, str]:
        """The one transaction of an upload: the quota check, the row and its audit event."""
        quotas = self.get_quotas(tenant_id)
        try:
            with self.db.session() as s:
                # A no-op write takes the tenant's row lock (PostgreSQL) or the database's
                # write lock (SQLite) first, so concurrent uploads of one tenant cannot both
                # pass the storage check.
                s.execute(update(Tenant).where(Tenant.id == tenant_id).values(name=Tenant.name))
                row = None
                if replace:
                    row = s.scalar(
                        select(Adapter)
                        .where(Adapter.tenant_id == tenant_id, Adapter.name == name)
                        .with_for_update()
                    )
                old_bytes = row.size_bytes if row is not None else 0
                check_storage(
                    quotas,
                    self._usage(s, tenant_id),
                    0 if row is not None else 1,
                    fields["size_bytes"] - old_bytes,
                )
                if row is not None:
                    for k, v in fields.items():
                        setattr(row, k, v)
                    row.version += 1
                    row.updated_at = utcnow()
                    kind = "replaced"
                else:
                    row = Adapter(tenant_id=tenant_id, name=name, version=1, **fields)
                    s.add(row)
                    kind = "uploaded"
                s.flush()
                s.add(self._event(row, kind, actor, {"version": row.version, "sha256": row.sha256}))
                s.flush()
                handle = self._handle(row)
        except IntegrityError:
            raise self._conflict(name) from None
        return handle, kind

    def list(self, tenant: TenantRef) -> list[AdapterHandle]:
        """The tenant's adapters, by name."""
        with self.db.session() as s:
            tenant_id = self._tenant_id(s, tenant)
            rows = s.scalars(
                select(Adapter).where(Adapter.tenant_id == tenant_id).order_by(Adapter.name)
            )
            return [self._handle(r) for r in rows]

    def list_all(self) -> list[AdapterHandle]:
        """Every tenant's adapters (admin dashboard)."""
        with self.db.session() as s:
            rows = s.scalars(select(Adapter).order_by(Adapter.tenant_id, Adapter.name))
            return [self._handle(r) for r in rows]

    def get(self, tenant: TenantRef, name: str) -> AdapterHandle:
        """One of the tenant's adapters; :class:`AdapterNotFound` if it has none by that name."""
        with self.db.session() as s:
            return self._handle(self._row(s, self._tenant_id(s, tenant), name))

    def resolve(self, tenant: TenantRef, model_name: str) -> AdapterHandle:
        """The adapter a request's ``model`` names, for the engine. Another tenant's adapter
        and a disabled one resolve exactly like a missing one."""
        handle = self.get(tenant, model_name)
        if handle.status != "ready":
            raise AdapterNotFound(
                f"adapter {model_name!r} not found; list yours with GET /v1/adapters or "
                "`loramux adapters list`"
            )
        return handle

    def get_by_id(self, adapter_id: int) -> AdapterHandle:
        """Any tenant's adapter by id (admin and engine use only)."""
        with self.db.session() as s:
            row = s.get(Adapter, adapter_id)
            if row is None:
                raise AdapterNotFound(f"adapter id {adapter_id} not found")
            return self._handle(row)

    def fetch_by_id(self, adapter_id: int) -> Path:
        """Adapter source for engines: the local PEFT folder of an adapter id."""
        return self.get_by_id(adapter_id).local_path()

    def delete(self, tenant: TenantRef, name: str, *, actor: str | None = None) -> AdapterHandle:
        """Remove the row (the name becomes free); the weights go at the next ``gc()``."""
        with self.db.session() as s:
            row = self._row(s, self._tenant_id(s, tenant), name)
            handle = self._handle(row)
            s.add(self._event(row, "deleted", actor, {"version": row.version}))
            s.delete(row)
        self._notify("deleted", handle)
        return handle

    def set_preset(
        self,
        tenant: TenantRef,
        name: str,
        preset: dict[str, Any] | None,
        *,
        actor: str | None = None,
    ) -> AdapterHandle:
        """Store (or with ``None`` clear) the adapter's default sampling preset."""
        checked = check_preset(preset, self.preset_check)
        with self.db.session() as s:
            row = self._row(s, self._tenant_id(s, tenant), name)
            row.default_preset = checked
            row.updated_at = utcnow()
            s.add(self._event(row, "preset_changed", actor, {"preset": checked}))
            s.flush()
            handle = self._handle(row)
        self._notify("preset_changed", handle)
        return handle

    def set_description(
        self, tenant: TenantRef, name: str, description: str | None, *, actor: str | None = None
    ) -> AdapterHandle:
        """Store (or with ``None`` clear) the adapter's description."""
        if description is not None and len(description) > MAX_DESCRIPTION_CHARS:
            raise InvalidDescription(
                f"a description may hold at most {MAX_DESCRIPTION_CHARS} characters, "
                f"got {len(description)}"
            )
        with self.db.session() as s:
            row = self._row(s, self._tenant_id(s, tenant), name)
            row.description = description or None
            row.updated_at = utcnow()
            s.add(self._event(row, "described", actor, None))
            s.flush()
            handle = self._handle(row)
        self._notify("described", handle)
        return handle

    # -- garbage collection ---------------------------------------------------------

    def gc(self, *, min_age_seconds: float = DEFAULT_GC_MIN_AGE_S,
           leftover_age_s: float = LEFTOVER_AGE_S) -> GcReport:
        """Delete stored objects no row references and no upload in progress marks (after
        ``min_age_seconds``), stale pending markers and crash leftovers (older than
        ``leftover_age_s``), and prune cache entries of adapters that no longer exist."""
        return collect(self, min_age_seconds=min_age_seconds, leftover_age_s=leftover_age_s)

    def remove_leftovers(self, min_age_s: float = LEFTOVER_AGE_S) -> list[str]:
        """Remove what a killed process left (scratch folders, temporary pieces)."""
        return remove_leftovers(self, min_age_s)


__all__ = ["CONFIG_NAME", "OBJECT_PREFIX", "GcReport", "RegistryService"]
