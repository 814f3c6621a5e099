"""The tenant API of adapter releases: versions (list with their last hour's numbers, get,
delete), the rollout (get, set, follow the latest again) and rollback.

Every call runs in the database bulkhead and is scoped to the caller's tenant (another
tenant's adapter is reported exactly like a missing one); registry errors go to the error
table as raised (bad weights 400, a version in the rollout 409, no rollback target 409).
A committed change reaches this server's resolver at once through the registry's listeners
and every other gateway and engine through the cluster's fan-out.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from typing import TYPE_CHECKING, Any

from starlette.concurrency import run_in_threadpool

from loramux.platform.adapter_api.schemas import (
    Percentiles,
    RolloutBody,
    RolloutInfo,
    VersionDeleted,
    VersionInfo,
    VersionList,
    VersionNumbers,
)
from loramux.platform.bulkheads import Dependencies
from loramux.platform.identity import Caller

if TYPE_CHECKING:
    from loramux.registry.handles import Release
    from loramux.registry.service import RegistryService
    from loramux.registry.usage import VersionStats as LedgerStats

STATS_WINDOW_S = 3600
"""The per-version numbers of ``GET /v1/adapters/{name}/versions`` cover the last hour."""


def version_stats(found: LedgerStats | None, window_s: int = STATS_WINDOW_S) -> VersionNumbers:
    """The API's view of one version's ledger numbers (zeros for a version without requests)."""
    if found is None:
        return VersionNumbers(window_s=window_s)
    return VersionNumbers(window_s=window_s, requests=found.requests, errors=found.errors,
                        prompt_tokens=found.prompt_tokens, cached_tokens=found.cached_tokens,
                        completion_tokens=found.completion_tokens,
                        ttft_ms=Percentiles(**found.ttft_ms), tpot_ms=Percentiles(**found.tpot_ms))


def actor_of(caller: Caller) -> str:
    return f"tenant:{caller.tenant.name}" if caller.tenant is not None else "admin"


class ReleaseService:
    """Versions, rollouts and rollback of the caller's adapters."""

    def __init__(self, registry: RegistryService, deps: Dependencies,
                 flush: Callable[[], object] | None = None) -> None:
        """``flush``: makes this server's finished requests visible in the numbers (the
        usage writer's flush; blocking, run in a worker thread)."""
        self.registry = registry
        self.deps = deps
        self.flush = flush

    async def _call(self, fn, *args, **kwargs):
        return await self.deps.db.call(fn, *args, **kwargs)

    def _versions_view(self, tenant_id: int, name: str) -> tuple[Release, dict]:
        release = self.registry.release(tenant_id, name)
        since = datetime.now(timezone.utc) - timedelta(seconds=STATS_WINDOW_S)
        stats = self.registry.usage.version_stats(since=since, tenant_id=tenant_id, adapter=name)
        return release, stats

    async def list_versions(self, caller: Caller, name: str) -> VersionList:
        if self.flush is not None:
            await run_in_threadpool(self.flush)
        release, stats = await self._call(self._versions_view, caller.tenant.id, name)
        return VersionList(
            data=[VersionInfo.of(h, release.rollout.weight(n),
                                    version_stats(stats.get((caller.tenant.id, name, n))))
                  for n, h in release.versions.items()],
            rollout=RolloutInfo.of(release))

    async def get_version(self, caller: Caller, name: str, number: int) -> VersionInfo:
        view = await self.list_versions(caller, name)
        found = next((v for v in view.data if v.version == number), None)
        if found is None:  # the registry's words: VersionNotFound (404)
            await self._call(self.registry.get_version, caller.tenant.id, name, number)
            return await self.get_version(caller, name, number)  # it appeared meanwhile
        return found

    async def delete_version(self, caller: Caller, name: str, number: int) -> VersionDeleted:
        handle = await self._call(self.registry.delete_version, caller.tenant.id, name, number,
                                  actor=actor_of(caller))
        return VersionDeleted(id=f"{handle.name}@{handle.version}")

    async def rollout(self, caller: Caller, name: str) -> RolloutInfo:
        return RolloutInfo.of(await self._call(self.registry.release, caller.tenant.id, name))

    async def set_rollout(self, caller: Caller, name: str, body: RolloutBody) -> RolloutInfo:
        weights: dict[str, Any] = body.weights
        return RolloutInfo.of(await self._call(self.registry.set_rollout, caller.tenant.id, name,
                                           weights, body.sticky, actor=actor_of(caller)))

    async def follow_latest(self, caller: Caller, name: str) -> RolloutInfo:
        return RolloutInfo.of(await self._call(self.registry.follow_latest, caller.tenant.id, name,
                                           actor=actor_of(caller)))

    async def rollback(self, caller: Caller, name: str) -> RolloutInfo:
        return RolloutInfo.of(await self._call(self.registry.rollback, caller.tenant.id, name,
                                           actor=actor_of(caller)))
