"""Adapters as requests see them (:class:`AdapterReleases`, a part of ``RegistryService``):
the handles of versions and what requests resolve through
(:meth:`AdapterReleases.release`), the listings, deleting a version, setting a rollout,
following the latest again, rolling back, and the retention quota an upload applies
(``max_versions_per_adapter``).

Versions are immutable: a version's weights and config never change; an upload adds a
version. A version the rollout names cannot be deleted (:class:`VersionInUse`). A removed
version's weights leave the object store at once when no other version uses them (and no
upload of the same bytes is in progress); its audit event (``version_removed``) says why.
Every change is committed with its audit event in one transaction, then listeners hear
it (``version_removed`` with the removed version's handle, ``rollout_changed`` /
``rolled_back`` with the newest version's).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from loramux.registry.errors import (
    AdapterNotFound,
    InvalidRollout,
    NoPreviousVersion,
    QuotaExceeded,
    VersionInUse,
    VersionNotFound,
)
from loramux.registry.gc import Storage, delete_if_unreferenced
from loramux.registry.handles import AdapterHandle, Release
from loramux.registry.models import Adapter, AdapterVersion, utcnow
from loramux.registry.rollouts import (
    BUCKETS,
    Rollout,
    check_sticky,
    next_previous_live,
    parse_weights,
)
from loramux.registry.tenants import TenantRef

if TYPE_CHECKING:
    from loramux.registry.audit import AdapterAudit
    from loramux.registry.events import EventBus
    from loramux.registry.tenants import Tenants

logger = logging.getLogger(__name__)


def _not_found(name: str) -> AdapterNotFound:
    return AdapterNotFound(
        f"adapter {name!r} not found; list yours with GET /v1/adapters or "
        "`loramux adapters list`"
    )


def rollout_of(adapter: Adapter, numbers: list[int]) -> Rollout:
    """The rollout in effect for an adapter row with these version numbers."""
    if adapter.rollout_weights is None:
        weights = ((max(numbers), BUCKETS),) if numbers else ()
        return Rollout(weights, adapter.rollout_sticky or "user", True, adapter.previous_live)
    weights = tuple(sorted((int(k), int(v)) for k, v in adapter.rollout_weights.items()))
    return Rollout(weights, adapter.rollout_sticky or "user", False, adapter.previous_live)


def describe(rollout: Rollout) -> str:
    """``3: 90%, 4: 10%`` (error messages)."""
    return ", ".join(f"{v}: {w}%" for v, w in rollout.weights)


class AdapterReleases:
    """Versions, rollouts and the handles of adapters, over the registry's storage (the
    database; the store and the cache a handle fetches through and a removed version's
    weights leave). Changes are announced on ``bus`` once committed."""

    def __init__(self, storage: Storage, tenants: Tenants, audit: AdapterAudit,
                 bus: EventBus) -> None:
        self.storage = storage
        self.db = storage.db
        self.tenants = tenants
        self.audit = audit
        self.bus = bus

    # --- handles -----------------------------------------------------------------------
    def _fetch(self, handle: AdapterHandle) -> Path:
        return self.storage.cache.fetch(self.storage.store, handle.object_key, handle.sha256,
                                        handle.config)

    def cached_path(self, handle: AdapterHandle) -> Path | None:
        """The adapter's local folder when the disk cache holds it (no store call), else None."""
        return self.storage.cache.lookup(handle.sha256, handle.config)

    def handle(self, row: Adapter, v: AdapterVersion) -> AdapterHandle:
        """The handle of version ``v`` of adapter ``row`` (its weights one call away)."""
        return AdapterHandle(
            id=row.id, tenant_id=row.tenant_id, name=row.name, version=v.number,
            base_model=v.base_model, rank=v.rank, alpha=v.alpha,
            target_modules=tuple(v.target_modules), sha256=v.sha256, size_bytes=v.size_bytes,
            object_key=v.object_key, status=row.status, default_preset=row.default_preset,
            config=dict(v.config), description=row.description, created_at=v.created_at,
            updated_at=row.updated_at, chat_template=row.chat_template,
            tool_call_parser=row.tool_call_parser, reasoning_parser=row.reasoning_parser,
            _fetch=self._fetch,
        )

    @staticmethod
    def versions(s: Session, adapter_id: int) -> list[AdapterVersion]:
        """The adapter's version rows, oldest first, in the caller's session."""
        return list(s.scalars(select(AdapterVersion).where(AdapterVersion.adapter_id == adapter_id)
                              .order_by(AdapterVersion.number)))

    def row(self, s: Session, tenant_id: int, name: str) -> Adapter:
        """The tenant's adapter row by name (:class:`AdapterNotFound` if absent)."""
        row = s.scalar(select(Adapter).where(Adapter.tenant_id == tenant_id, Adapter.name == name))
        if row is None:
            raise _not_found(name)
        return row

    def locked_row(self, s: Session, tenant: TenantRef, name: str) -> Adapter:
        """The adapter's row, locked for the rest of the transaction: a no-op write takes
        the row lock (PostgreSQL) or the database's write lock (SQLite) before the read, so
        two concurrent changes of one rollout cannot both build on the same state."""
        tenant_id = self.tenants.tenant_id(s, tenant)
        s.execute(update(Adapter).where(Adapter.tenant_id == tenant_id, Adapter.name == name)
                  .values(last_version=Adapter.last_version))
        return self.row(s, tenant_id, name)

    def newest(self, s: Session, rows) -> list[AdapterHandle]:
        """One handle per adapter row: its newest version."""
        rows = list(rows)
        if not rows:
            return []
        newest: dict[int, AdapterVersion] = {}
        for v in s.scalars(select(AdapterVersion).where(
                AdapterVersion.adapter_id.in_([r.id for r in rows]))):
            if v.adapter_id not in newest or v.number > newest[v.adapter_id].number:
                newest[v.adapter_id] = v
        return [self.handle(r, newest[r.id]) for r in rows if r.id in newest]

    def _release(self, row: Adapter, versions: list[AdapterVersion]) -> Release:
        return Release({v.number: self.handle(row, v) for v in versions},
                       rollout_of(row, [v.number for v in versions]))

    # --- reading -----------------------------------------------------------------------
    def list(self, tenant: TenantRef) -> list[AdapterHandle]:
        """The tenant's adapters by name, each as its newest version."""
        with self.db.session() as s:
            tenant_id = self.tenants.tenant_id(s, tenant)
            return self.newest(s, s.scalars(
                select(Adapter).where(Adapter.tenant_id == tenant_id).order_by(Adapter.name)))

    def list_all(self) -> list[AdapterHandle]:
        """Every tenant's adapters, each as its newest version (admin dashboard)."""
        with self.db.session() as s:
            return self.newest(s, s.scalars(select(Adapter).order_by(Adapter.tenant_id,
                                                                      Adapter.name)))

    def get(self, tenant: TenantRef, name: str) -> AdapterHandle:
        """One of the tenant's adapters as its newest version; :class:`AdapterNotFound` if
        it has none by that name."""
        with self.db.session() as s:
            return self.newest(s, [self.row(s, self.tenants.tenant_id(s, tenant), name)])[0]

    def get_by_id(self, adapter_id: int, version: int | None = None) -> AdapterHandle:
        """Any tenant's adapter by id (admin and engine use only): one version, default
        the newest."""
        with self.db.session() as s:
            row = s.get(Adapter, adapter_id)
            versions = self.versions(s, adapter_id) if row is not None else []
            if version is not None:
                versions = [v for v in versions if v.number == version]
            if not versions:
                raise AdapterNotFound(f"adapter id {adapter_id} (version {version}) not found")
            return self.handle(row, versions[-1])

    def fetch_by_id(self, adapter_id: int, version: int | None = None) -> Path:
        """Adapter source for engines: the local PEFT folder of an adapter id's version."""
        return self.get_by_id(adapter_id, version).local_path()

    def release(self, tenant: TenantRef, name: str) -> Release:
        """The adapter's retained versions and its rollout; :class:`AdapterNotFound` if
        the tenant has no adapter by that name (another tenant's looks the same)."""
        with self.db.session() as s:
            row = self.row(s, self.tenants.tenant_id(s, tenant), name)
            return self._release(row, self.versions(s, row.id))

    def resolve(self, tenant: TenantRef, name: str) -> Release:
        """What a request's ``model`` names, for serving: :meth:`release` of a ready
        adapter. Another tenant's adapter and a disabled one resolve like a missing one."""
        found = self.release(tenant, name)
        if found.newest.status != "ready":
            raise _not_found(name)
        return found

    def get_version(self, tenant: TenantRef, name: str, number: int) -> AdapterHandle:
        """One version of one of the tenant's adapters (:class:`VersionNotFound` if absent)."""
        found = self.release(tenant, name)
        if number not in found.versions:
            raise VersionNotFound(
                f"adapter {name!r} has no version {number}; its versions: "
                f"{', '.join(map(str, found.versions))}")
        return found.versions[number]

    def list_all_versions(self) -> list[AdapterHandle]:
        """Every retained version of every tenant's adapters (admin, gc)."""
        with self.db.session() as s:
            rows = s.execute(select(Adapter, AdapterVersion)
                             .join(AdapterVersion, AdapterVersion.adapter_id == Adapter.id)
                             .order_by(Adapter.tenant_id, Adapter.name, AdapterVersion.number))
            return [self.handle(a, v) for a, v in rows]

    def releases(self) -> list[Release]:
        """Every adapter of every tenant with its versions and rollout (the dashboard)."""
        with self.db.session() as s:
            rows = list(s.scalars(select(Adapter).order_by(Adapter.tenant_id, Adapter.name)))
            by_adapter: dict[int, list[AdapterVersion]] = {r.id: [] for r in rows}
            for v in s.scalars(select(AdapterVersion).order_by(AdapterVersion.number)):
                by_adapter.setdefault(v.adapter_id, []).append(v)
            return [self._release(r, by_adapter[r.id]) for r in rows if by_adapter[r.id]]

    # --- changing the rollout ----------------------------------------------------------
    def set_rollout(self, tenant: TenantRef, name: str, weights: Any,
                    sticky: Any = "user", *, actor: str | None = None) -> Release:
        """Spread the plain name over versions by ``weights`` (``{"3": 90, "4": 10}``),
        ``sticky`` per ``user``, ``key`` or ``none``. Every version named must exist.
        Raises :class:`InvalidRollout` (nothing changed) or :class:`AdapterNotFound`."""
        parsed = parse_weights(weights)
        sticky = check_sticky(sticky)
        return self._change_rollout(tenant, name, parsed, sticky, "rollout_changed", actor)

    def follow_latest(self, tenant: TenantRef, name: str, *,
                      actor: str | None = None) -> Release:
        """Drop the explicit rollout: the newest version takes every request, and each
        upload moves there (the default of a new adapter)."""
        return self._change_rollout(tenant, name, None, None, "rollout_changed", actor)

    def rollback(self, tenant: TenantRef, name: str, *,
                 actor: str | None = None) -> Release:
        """Every request to the previous live version, in one step
        (:class:`NoPreviousVersion` when there is none)."""
        return self._change_rollout(tenant, name, "previous", None, "rolled_back", actor)

    def _change_rollout(self, tenant: TenantRef, name: str, weights: Any,
                        sticky: str | None, kind: str, actor: str | None) -> Release:
        with self.db.session() as s:
            row = self.locked_row(s, tenant, name)
            versions = self.versions(s, row.id)
            numbers = [v.number for v in versions]
            old = rollout_of(row, numbers)
            if weights == "previous":
                target = old.rollback_to
                if target is None or target not in numbers or target == old.live:
                    raise NoPreviousVersion(
                        f"adapter {name!r} has no previous live version to roll back to "
                        f"(its rollout: {describe(old)}); set one with PUT "
                        f"/v1/adapters/{name}/rollout")
                weights = ((target, BUCKETS),)
            if weights is not None:
                unknown = [v for v, _ in weights if v not in numbers]
                if unknown:
                    raise InvalidRollout(
                        f"adapter {name!r} has no version {unknown[0]}; its versions: "
                        f"{', '.join(map(str, numbers))}", param=f"weights.{unknown[0]}")
                row.rollout_weights = {str(v): w for v, w in weights}
            else:
                row.rollout_weights = None
                weights = ((max(numbers), BUCKETS),)
            if sticky is not None:
                row.rollout_sticky = sticky
            row.previous_live = next_previous_live(old, weights)
            row.updated_at = utcnow()
            new = rollout_of(row, numbers)
            s.add(self.audit.event(row, kind, actor, {"from": old.to_dict(), "to": new.to_dict()}))
            s.flush()
            release = self._release(row, versions)
        self.bus.notify(kind, release.newest)
        return release

    # --- removing versions -------------------------------------------------------------
    def delete_version(self, tenant: TenantRef, name: str, number: int, *,
                       actor: str | None = None) -> AdapterHandle:
        """Remove one version (its weights go at once unless another version uses them).
        :class:`VersionInUse` for a version the rollout names (409: change the rollout
        first), :class:`VersionNotFound` for one that does not exist."""
        with self.db.session() as s:
            row = self.locked_row(s, tenant, name)
            versions = self.versions(s, row.id)
            rollout = rollout_of(row, [v.number for v in versions])
            target = next((v for v in versions if v.number == number), None)
            if target is None:
                raise VersionNotFound(
                    f"adapter {name!r} has no version {number}; its versions: "
                    f"{', '.join(str(v.number) for v in versions)}")
            if number in rollout.versions:
                follows = " (it follows the latest version)" if rollout.follow_latest else ""
                raise VersionInUse(
                    f"version {number} of {name!r} is in its rollout ({describe(rollout)})"
                    f"{follows}; move its weight to other versions with PUT "
                    f"/v1/adapters/{name}/rollout first")
            removed = [self.remove_version(s, row, target, "deleted", actor)]
        self.after_removal(removed)
        return removed[0]

    def remove_version(self, s: Session, row: Adapter, v: AdapterVersion,
                       reason: str, actor: str | None) -> AdapterHandle:
        """Delete one version row in the caller's transaction (with its audit event)."""
        handle = self.handle(row, v)
        if row.previous_live == v.number:
            row.previous_live = None
        s.add(self.audit.event(row, "version_removed", actor,
                               {"version": v.number, "sha256": v.sha256, "reason": reason}))
        s.delete(v)
        row.updated_at = utcnow()
        return handle

    def retain(self, s: Session, row: Adapter, limit: int | None,
               keep: int, actor: str | None) -> list[AdapterHandle]:
        """Apply ``max_versions_per_adapter`` after an upload added version ``keep``: remove
        the oldest versions the rollout does not name (the rollback target last); raise
        :class:`QuotaExceeded` when too few are free to go."""
        if limit is None:
            return []
        versions = self.versions(s, row.id)
        excess = len(versions) - limit
        if excess <= 0:
            return []
        rollout = rollout_of(row, [v.number for v in versions])
        in_use = set(rollout.versions) | {keep}
        free = sorted((v for v in versions if v.number not in in_use),
                      key=lambda v: (v.number == rollout.rollback_to, v.number))
        if len(free) < excess:
            raise QuotaExceeded("max_versions_per_adapter", limit, len(versions) - 1, 1,
                                f"versions of {row.name!r} (every older one is in its rollout)")
        return [self.remove_version(s, row, v, "retention", actor) for v in free[:excess]]

    def after_removal(self, removed: list[AdapterHandle]) -> None:
        """Once the removal is committed: listeners hear it, and weights nothing else uses
        leave the store (a failure there is left to ``gc``)."""
        for handle in removed:
            self.bus.notify("version_removed", handle)
        for handle in removed:
            try:
                delete_if_unreferenced(self.storage, handle.object_key)
            except Exception as e:  # gc removes it later
                logger.warning("could not remove the weights of %s v%d now: %s",
                               handle.name, handle.version, e)
