"""The admin API's logic: what the Overview, Adapters, Tenants and Audit views show, and
the evict / pin / unpin / warm actions, over a :class:`~loramux.platform.admin.fleet.Fleet`
and (optionally) the registry.

Rows are keyed by the engine key (``"<tenant id>/<name>@<digest>"``). Registry adapters
no engine has loaded show up with tier ``store``; acting on one registers it with the
engines first. Registry reads run in worker threads, never on the event loop.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from datetime import datetime, timedelta, timezone
from typing import TYPE_CHECKING

from starlette.concurrency import run_in_threadpool

from loramux.platform.admin.actions import ACTIONS
from loramux.platform.admin.activity import Activity
from loramux.platform.admin.fleet import Fleet
from loramux.platform.admin.schemas import (
    ActionResult,
    AuditEvent,
    AuditLog,
    Overview,
    QuotaUse,
    RejectionInfo,
    ReleaseRow,
    Releases,
    ReleaseVersion,
    Residency,
    ResidencyRow,
    TenantInfo,
    TenantList,
)
from loramux.platform.errors import BadRequest, NotFound
from loramux.platform.identity import EngineKey
from loramux.platform.openai.resolver import ModelResolver
from loramux.registry.chat import template_digest

if TYPE_CHECKING:
    from loramux.registry.handles import AdapterHandle
    from loramux.registry.service import RegistryService

logger = logging.getLogger(__name__)


def _when(epoch: float | None) -> datetime | None:
    return datetime.fromtimestamp(epoch, timezone.utc) if epoch is not None else None


class AdminService:
    """Reads and actions of the dashboard and its JSON API."""

    def __init__(self, fleet: Fleet, registry: RegistryService | None, resolver: ModelResolver,
                 activity: Activity, *, base_model: str, dtype: str, device: str,
                 base_family: str | None = None, weight_format: str | None = None,
                 weight_bytes: int | None = None) -> None:
        self.fleet = fleet
        self.registry = registry
        self.resolver = resolver
        self.activity = activity
        self.base_model, self.dtype, self.device = base_model, dtype, device
        self.base_family = base_family
        self.weight_format, self.weight_bytes = weight_format, weight_bytes
        self.health: Callable[[], Awaitable[tuple[dict[str, str], dict[str, str]]]] | None = None
        """The server's dependency report for the overview (``dependency_report``)."""
        self.goodput: Callable[[], dict[str, float | int | None]] | None = None
        """The server's goodput against its targets (``Metrics.goodput_report``)."""
        self.flush_usage: Callable[[], object] | None = None
        """The usage writer's flush (blocking): the releases' numbers see this server's
        last requests; None where nothing writes usage (a gateway)."""

    def _registry_rows(self) -> list[tuple[str, AdapterHandle, str]]:
        if self.registry is None:
            return []
        tenants = {t.id: t.name for t in self.registry.list_tenants()}
        return [
            (str(EngineKey.for_handle(h)), h, tenants.get(h.tenant_id, "?"))
            for h in self.registry.list_all_versions()
        ]

    async def overview(self) -> Overview:
        views = await self.fleet.engines()
        deps, reasons = await self.health() if self.health is not None else ({}, {})
        return Overview(base_model=self.base_model, base_family=self.base_family,
                        dtype=self.dtype, device=self.device, weight_format=self.weight_format,
                        weight_bytes=self.weight_bytes, engines=[v.summary for v in views], dependencies=deps,
                        dependency_reasons=reasons,
                        goodput=await self._goodput_by_name())

    async def _goodput_by_name(self) -> dict | None:
        """The goodput report with tenants by name (the metrics count them by id; by id where
        the registry does not answer within a second: the overview never waits on it)."""
        if self.goodput is None:
            return None
        report = dict(self.goodput())
        names: dict[str, str] = {}
        if self.registry is not None and report.get("tenants"):
            try:
                tenants = await asyncio.wait_for(asyncio.to_thread(self.registry.list_tenants), 1.0)
                names = {str(t.id): t.name for t in tenants}
            except Exception:  # a slow or failing database: ids instead of names
                logger.warning("tenant names for the goodput overview unavailable", exc_info=True)
        report["tenants"] = {names.get(t, t) or "-": c for t, c in report.get("tenants", {}).items()}
        return report

    async def adapters(self) -> Residency:
        """Every adapter per engine (and the registry's not loaded anywhere)."""
        views = await self.fleet.engines()
        rows: dict[tuple[str, str], ResidencyRow] = {}
        for view in views:
            for r in view.rows:
                rows[(view.summary.id, r["name"])] = ResidencyRow(
                    key=r["name"], engine=view.summary.id,
                    evict_pending=r["name"] in view.evict_pending, **r)

        def place(key: str) -> list[ResidencyRow]:
            found = [row for (_, k), row in rows.items() if k == key]
            if not found:
                rows[("", key)] = ResidencyRow(key=key, name=key, tier="store", engine="")
                found = [rows[("", key)]]
            return found

        for name, served in self.resolver.static.items():
            for row in place(served.lora.lora_name):
                row.tenant, row.adapter, row.source = None, name, "static"
        for key, handle, tenant in await self.resolver.deps.db.call(self._registry_rows):
            for row in place(key):
                row.tenant, row.adapter, row.source = tenant, handle.name, "registry"
                row.version, row.size_bytes = handle.version, handle.size_bytes
                row.rank = row.rank or handle.rank
                row.kind = row.kind or handle.kind
        for row in rows.values():
            act = self.activity.adapter(row.key)
            row.in_flight, row.requests_1m, row.tokens_1m = (
                act["in_flight"], act["requests_1m"], act["tokens_1m"])
            row.tokens_per_s, row.last_used = act["tokens_per_s"], _when(act["last_used"])
        return Residency(
            data=sorted(rows.values(), key=lambda r: (r.tier == "store", r.key, r.engine)),
            engine=views[0].summary,
        )

    async def act(self, key: str, action: str, engine: str | None = None) -> ActionResult:
        """Run an action on one engine or (``engine`` None) every engine."""
        if action not in ACTIONS:
            raise NotFound(f"unknown action {action!r}; use one of {', '.join(ACTIONS)}")
        views = await self.fleet.engines()
        if not any(v.summary.lora_enabled for v in views):
            raise BadRequest("this server was started without LoRA")
        request = handle = None
        if not all(self.fleet.knows(v, key) for v in views):
            request, handle = await self._lora_request(key)
        outcomes = await self.fleet.act(engine, action, key, request)  # LoRAError: 422
        done = any(o.done for o in outcomes)
        deferred = [o.engine for o in outcomes if o.deferred]
        detail = None
        if deferred:
            detail = (f"eviction deferred on {', '.join(deferred)}: the slot frees once the "
                      "running requests that use it finish")
        elif action in ("evict", "unpin") and not done:
            detail = "not loaded"
        recorded = {"evict": "evicted", "pin": "pinned", "unpin": "unpinned"}.get(action)
        if recorded and done and self.registry is not None:
            await self._record(key, handle, recorded)
        logger.info("admin %s %s", action, key,
                    extra={"adapter": key, "action": action, "engine": engine or "all"})
        return ActionResult(key=key, action=action, done=done, detail=detail,
                            deferred=bool(deferred), engines=[o.engine for o in outcomes])

    async def _lora_request(self, key: str):
        for served in self.resolver.static.values():
            if served.lora.lora_name == key:
                return served.lora, None
        for k, handle, _ in await self.resolver.deps.db.call(self._registry_rows):
            if k == key:
                path = await self.resolver.deps.store.call(handle.local_path)
                served = self.resolver.served_from_handle(handle, path)
                return served.lora, handle
        raise NotFound(f"adapter {key!r} not found", code="adapter_not_found")

    async def _record(self, key: str, handle: AdapterHandle | None, kind: str) -> None:
        try:
            if handle is None:
                for k, h, _ in await self.resolver.deps.db.call(self._registry_rows):
                    if k == key:
                        handle = h
                        break
            if handle is not None:
                await self.resolver.deps.db.call(self.registry.record_event, handle.id, kind,
                                        actor="admin")
        except Exception:
            logger.exception("could not record the %s of %s", kind, key)

    # --- releases: versions, rollouts, rollback ------------------------------------------
    def _releases(self, window_s: int) -> Releases:
        reg = self.registry
        if reg is None:
            return Releases(data=[], window_s=window_s)
        names = {t.id: t.name for t in reg.list_tenants()}
        since = datetime.now(timezone.utc) - timedelta(seconds=window_s)
        stats = reg.usage.version_stats(since=since)
        rows = []
        for release in reg.releases():
            r = release.rollout
            versions = []
            for n, h in release.versions.items():
                st = stats.get((h.tenant_id, h.name, n))
                versions.append(ReleaseVersion(
                    version=n, weight=r.weight(n), created_at=h.created_at,
                    size_bytes=h.size_bytes, sha256=h.sha256,
                    **({} if st is None else dict(
                        requests=st.requests, errors=st.errors, prompt_tokens=st.prompt_tokens,
                        completion_tokens=st.completion_tokens,
                        ttft_p50_ms=st.ttft_ms.get("p50"), ttft_p99_ms=st.ttft_ms.get("p99"),
                        tpot_p50_ms=st.tpot_ms.get("p50"), tpot_p99_ms=st.tpot_ms.get("p99")))))
            newest, template = release.newest, release.newest.chat_template
            rows.append(ReleaseRow(
                tenant=names.get(release.tenant_id), tenant_id=release.tenant_id,
                adapter=release.name, sticky=r.sticky, follow_latest=r.follow_latest,
                rollback_to=r.rollback_to, versions=versions,
                split=" · ".join(f"v{v} {w}%" for v, w in r.weights if w),
                tool_call_parser=newest.tool_call_parser,
                reasoning_parser=newest.reasoning_parser,
                chat_template_sha256=template_digest(template) if template else None,
                chat_template_chars=len(template) if template else None))
        return Releases(data=rows, window_s=window_s)

    async def releases(self, window_s: int = 3600) -> Releases:
        """Every tenant adapter's versions, live split and last-hour numbers per version."""
        if self.flush_usage is not None:
            await run_in_threadpool(self.flush_usage)
        return await self.resolver.deps.db.call(self._releases, window_s)

    async def rollback(self, tenant: str, adapter: str) -> ReleaseRow:
        """Roll one tenant's adapter back to its previous live version (the dashboard's
        button); the change reaches every server like a tenant's own."""
        if self.registry is None:
            raise NotFound("this server runs without an adapter registry")
        tenants = await self.resolver.deps.db.call(self.registry.list_tenants)
        tenant_id = next((t.id for t in tenants if t.name == tenant), None)
        if tenant_id is None:
            raise NotFound(f"no tenant {tenant[:60]!r}", param="tenant", code="tenant_not_found")
        await self.resolver.deps.db.call(self.registry.rollback, tenant_id, adapter,
                                         actor="admin")
        logger.info("admin rollback %s/%s", tenant, adapter,
                    extra={"tenant": tenant, "adapter": adapter, "action": "rollback"})
        for row in (await self.releases()).data:
            if row.tenant_id == tenant_id and row.adapter == adapter:
                return row
        raise NotFound(f"adapter {adapter!r} not found", code="adapter_not_found")

    # --- tenants and audit (registry reads, in a worker thread) ---------------------------
    def _tenants(self) -> TenantList:
        reg = self.registry
        if reg is None:
            return TenantList(data=[])
        keys = reg.list_api_keys()
        out = []
        for t in reg.list_tenants():
            quotas, usage = reg.get_quotas(t.id), reg.get_usage(t.id)
            act = self.activity.tenant(t.id)
            used = {
                "max_concurrent_requests": act["in_flight"],
                "requests_per_minute": act["requests_1m"],
                "tokens_per_minute": act["tokens_1m"],
                "max_adapters": usage.adapters,
                "max_stored_bytes": usage.stored_bytes,
            }
            out.append(TenantInfo(
                id=t.id, name=t.name,
                quotas=[QuotaUse(name=n, used=used.get(n), limit=getattr(quotas, n))
                        for n in quotas.to_dict()],
                rejections=[RejectionInfo(at=_when(r.at), code=r.code, message=r.message)
                            for r in self.activity.rejections(t.id)],
                keys=[k for k in keys if k.tenant_id == t.id],
            ))
        return TenantList(data=out)

    async def tenants(self) -> TenantList:
        return await self.resolver.deps.db.call(self._tenants)

    def _audit(self, tenant: str | None, kind: str | None, limit: int) -> AuditLog:
        reg = self.registry
        if reg is None:
            return AuditLog(data=[])
        names = {t.id: t.name for t in reg.list_tenants()}
        if tenant is not None and tenant not in names.values():
            return AuditLog(data=[])
        events = [
            AuditEvent(at=e.created_at, kind=e.kind, tenant=names.get(e.tenant_id),
                       subject=e.adapter_name, actor=e.actor, details=e.details)
            for e in reg.events(tenant, limit=limit)
        ]
        for k in reg.list_api_keys(tenant):
            for when, what in ((k.created_at, "key_created"), (k.revoked_at, "key_revoked")):
                if when is not None:
                    events.append(AuditEvent(at=when, kind=what, tenant=names.get(k.tenant_id),
                                             subject=k.prefix, actor="operator"))
        if kind:
            events = [e for e in events if e.kind == kind]
        events.sort(key=lambda e: e.at, reverse=True)
        return AuditLog(data=events[:limit])

    async def audit(self, tenant: str | None = None, kind: str | None = None,
                    limit: int = 200) -> AuditLog:
        """Recent adapter and key events, newest first, optionally of one tenant / kind."""
        return await self.resolver.deps.db.call(self._audit, tenant or None, kind or None, limit)
