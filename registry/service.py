"""``RegistryService``: adapters over SQL + an object store (tenants, keys and quotas:
tenants.py; versions and rollouts: versions.py; the audit log: audit.py).

Upload is validate → write the weights to the store under a content-addressed key →
commit the new version (and its audit event, and what the retention quota removes) in
one transaction. A failure at any point leaves no row; an object written by a failed
upload is unreferenced and ``gc()`` removes it. Every adapter query is scoped to one
tenant: another tenant's adapter is reported exactly like a missing one.
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
    AdapterVersion,
    Tenant,
    utcnow,
)
from loramux.registry.names import check_name
from loramux.registry.presets import PresetCheck, check_preset
from loramux.registry.quotas import Quotas, check_storage
from loramux.registry.rollouts import BUCKETS, next_previous_live
from loramux.registry.store import ObjectStore, sha256_file
from loramux.registry.tenants import TenantAccounts, TenantRef
from loramux.registry.usage import UsageLedger
from loramux.registry.versions import AdapterReleases, rollout_of

logger = logging.getLogger(__name__)


class RegistryService(TenantAccounts, AdapterAudit, AdapterReleases):
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
        self.usage = UsageLedger(db)
        """Finished requests' usage records (appended by the platform's usage writer)."""

    # -- events ---------------------------------------------------------------------

    def subscribe(self, listener: Listener) -> Callable[[], None]:
        """Call ``listener(kind, handle)`` after each committed change (uploaded,
        version_added, version_removed, rollout_changed, rolled_back, deleted,
        preset_changed, described, evicted, exported; ``key_revoked`` and
        ``quotas_changed`` with handle None); the platform relays it to engines and caches.
        Returns the function that unsubscribes it."""
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

    # -- adapters -------------------------------------------------------------------
    def _fetch(self, handle: AdapterHandle) -> Path:
        return self.cache.fetch(self.store, handle.object_key, handle.sha256, handle.config)

    def cached_path(self, handle: AdapterHandle) -> Path | None:
        """The adapter's local folder when the disk cache holds it (no store call), else None."""
        return self.cache.lookup(handle.sha256, handle.config)

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
        replace: bool = True,
        default_preset: dict[str, Any] | None = None,
    ) -> AdapterHandle:
        """Validate an adapter folder or archive and register it as ``name``: version 1
        of a new adapter, or the next version of an existing one. An adapter that follows
        the latest version (no explicit rollout) sends every request to the new version at
        once; one with an explicit rollout keeps it (``name@N`` reaches the new version).
        The tenant's ``max_versions_per_adapter`` removes the oldest version the rollout
        does not name. ``replace=False`` refuses an existing name instead
        (:class:`AdapterConflict`).

        Raises AdapterValidationError (bad adapter), InvalidName, InvalidPreset,
        TenantNotFound, QuotaExceeded (``max_adapters``, ``max_stored_bytes``,
        ``max_versions_per_adapter``), AdapterConflict, ObjectStoreError.
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
            )
            # the marker keeps gc() off the object until the row is committed (or not)
            with pending_marker(self.store, digest, self.tmp_dir):
                # Always (re)write: it refreshes the object's age too.
                self.store.put_file(fields["object_key"], weights_path, sha256=digest)
                handle, kind, removed = self._commit_upload(
                    tenant_id, name, fields, preset, actor, replace)
        self._notify(kind, handle)
        self._after_removal(removed)
        return handle

    @staticmethod
    def _conflict(name: str) -> AdapterConflict:
        return AdapterConflict(
            f"adapter {name!r} already exists; pick another name, or upload it as a new "
            "version (replace)"
        )

    def _commit_upload(
        self,
        tenant_id: int,
        name: str,
        fields: dict[str, Any],
        preset: dict[str, Any] | None,
        actor: str | None,
        replace: bool,
    ) -> tuple[AdapterHandle, str, list[AdapterHandle]]:
        """The one transaction of an upload: the new version, the quota checks, what the
        retention removes and the audit events."""
        quotas = self.get_quotas(tenant_id)
        try:
            with self.db.session() as s:
                # A no-op write takes the tenant's row lock (PostgreSQL) or the database's
                # write lock (SQLite) first, so concurrent uploads of one tenant cannot both
                # pass the storage checks.
                s.execute(update(Tenant).where(Tenant.id == tenant_id).values(name=Tenant.name))
                before = self._usage(s, tenant_id)
                row = s.scalar(
                    select(Adapter)
                    .where(Adapter.tenant_id == tenant_id, Adapter.name == name)
                    .with_for_update()
                )
                if row is not None and not replace:
                    raise self._conflict(name)
                if row is None:
                    check_storage(quotas, before, 1, 0)
                    row = Adapter(tenant_id=tenant_id, name=name, last_version=0,
                                  status="ready", rollout_sticky="user")
                    s.add(row)
                    s.flush()
                    kind, numbers = "uploaded", []
                else:
                    kind = "version_added"
                    numbers = [v.number for v in self._versions(s, row.id)]
                if preset is not None:
                    row.default_preset = preset
                number = row.last_version + 1
                version = AdapterVersion(adapter_id=row.id, number=number, **fields)
                s.add(version)
                row.last_version = number
                row.status = "ready"
                row.updated_at = utcnow()
                if row.rollout_weights is None and numbers:  # follows the latest: moves on
                    row.previous_live = next_previous_live(
                        rollout_of(row, numbers), ((number, BUCKETS),))
                s.flush()
                removed = self._retain(s, row, quotas.max_versions_per_adapter, number, actor)
                s.flush()
                after = self._usage(s, tenant_id)
                check_storage(quotas, before, 0, after.stored_bytes - before.stored_bytes)
                s.add(self._event(row, kind, actor, {"version": number, "sha256": version.sha256}))
                s.flush()
                handle = self._handle(row, version)
        except IntegrityError:
            raise self._conflict(name) from None
        return handle, kind, removed

    def _newest(self, s: Session, rows) -> list[AdapterHandle]:
        """One handle per adapter row: its newest version."""
        rows = list(rows)
        if not rows:
            return []
        newest: dict[int, AdapterVersion] = {}
        for v in s.scalars(select(AdapterVersion).where(
                AdapterVersion.adapter_id.in_([r.id for r in rows]))):
            if v.adapter_id not in newest or v.number > newest[v.adapter_id].number:
                newest[v.adapter_id] = v
        return [self._handle(r, newest[r.id]) for r in rows if r.id in newest]

    def list(self, tenant: TenantRef) -> list[AdapterHandle]:
        """The tenant's adapters by name, each as its newest version."""
        with self.db.session() as s:
            tenant_id = self._tenant_id(s, tenant)
            return self._newest(s, s.scalars(
                select(Adapter).where(Adapter.tenant_id == tenant_id).order_by(Adapter.name)))

    def list_all(self) -> list[AdapterHandle]:
        """Every tenant's adapters, each as its newest version (admin dashboard)."""
        with self.db.session() as s:
            return self._newest(s, s.scalars(select(Adapter).order_by(Adapter.tenant_id,
                                                                       Adapter.name)))

    def get(self, tenant: TenantRef, name: str) -> AdapterHandle:
        """One of the tenant's adapters as its newest version; :class:`AdapterNotFound` if
        it has none by that name."""
        with self.db.session() as s:
            return self._newest(s, [self._row(s, self._tenant_id(s, tenant), name)])[0]

    def get_by_id(self, adapter_id: int, version: int | None = None) -> AdapterHandle:
        """Any tenant's adapter by id (admin and engine use only): one version, default
        the newest."""
        with self.db.session() as s:
            row = s.get(Adapter, adapter_id)
            versions = self._versions(s, adapter_id) if row is not None else []
            if version is not None:
                versions = [v for v in versions if v.number == version]
            if not versions:
                raise AdapterNotFound(f"adapter id {adapter_id} (version {version}) not found")
            return self._handle(row, versions[-1])

    def fetch_by_id(self, adapter_id: int, version: int | None = None) -> Path:
        """Adapter source for engines: the local PEFT folder of an adapter id's version."""
        return self.get_by_id(adapter_id, version).local_path()

    def delete(self, tenant: TenantRef, name: str, *, actor: str | None = None) -> AdapterHandle:
        """Remove the adapter and every version (the name becomes free); the weights go at
        the next ``gc()``. Listeners hear ``deleted`` with the newest version's handle."""
        with self.db.session() as s:
            row = self._row(s, self._tenant_id(s, tenant), name)
            handle = self._newest(s, [row])[0]
            versions = [v.number for v in self._versions(s, row.id)]
            s.add(self._event(row, "deleted", actor, {"version": row.last_version,
                                                      "versions": versions}))
            s.delete(row)
        self._notify("deleted", handle)
        return handle

    def _change(self, tenant: TenantRef, name: str, kind: str, actor: str | None,
                details: dict[str, Any] | None, **values: Any) -> AdapterHandle:
        with self.db.session() as s:
            row = self._row(s, self._tenant_id(s, tenant), name)
            for k, v in values.items():
                setattr(row, k, v)
            row.updated_at = utcnow()
            s.add(self._event(row, kind, actor, details))
            s.flush()
            handle = self._newest(s, [row])[0]
        self._notify(kind, handle)
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
        checked = check_preset(preset, self.preset_check)
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
