"""What ``/ready`` and the dashboard's overview ask every dependency of a server: the
registry's database and object store through their bulkheads, and each :class:`Pingable`
(the tenant limiter's backend: Redis, or nothing in-process) directly, all at once
within :data:`PROBE_TIMEOUT_S`."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from typing import Any, Protocol

from loramux.platform.bulkheads import Bulkhead, Dependencies

PROBE_TIMEOUT_S = 1.0
"""Seconds each dependency probe of ``/ready`` may take (Kubernetes' probe default is 1 s
for the whole request: the probes run concurrently)."""

Report = tuple[dict[str, str], dict[str, str]]
"""``(status per dependency, reason per failing one)``."""


class Pingable(Protocol):
    """A dependency asked directly (no bulkhead), e.g. a limiter backend."""

    dependency: str | None
    """The name ``/ready`` reports it under (``redis``); None = nothing outside the
    process (not reported)."""

    async def ping(self) -> None:
        """Raise unless the dependency answers. Called by every ``/ready``."""
        ...


async def probe(bulkhead: Bulkhead, fn: Callable[[], Any], timeout: float) -> tuple[str, str | None]:
    """``(status, reason)`` of one dependency for ``/ready``: ``down`` when the probe
    fails (or the breaker is open), ``degraded`` when it answers but recent calls failed
    or the pool is busy, else ``ok``. ``reason`` may name hosts: admins only."""
    try:
        await bulkhead.call(fn, timeout=timeout)
    except Exception as exc:  # every failure is an answer here
        return "down", f"{type(exc).__name__}: {exc}"
    status = bulkhead.status()
    return status, (bulkhead.last_error if status != "ok" else None)


async def dependency_report(deps: Dependencies, registry: Any = None,
                            pingables: Iterable[Pingable] = (),
                            timeout: float = PROBE_TIMEOUT_S) -> Report:
    """Every dependency of a server, probed concurrently within ``timeout``: the
    registry's database and object store through ``deps``' bulkheads, each of
    ``pingables`` with a dependency directly."""
    probes = {}
    if registry is not None:
        probes["database"] = probe(deps.db, registry.db.ping, timeout)
        probes["object store"] = probe(deps.store, registry.store.ping, timeout)
    for p in pingables:
        if p.dependency is not None:
            probes[p.dependency] = _ping(p, timeout)
    results = await asyncio.gather(*probes.values())
    statuses = {name: status for name, (status, _) in zip(probes, results, strict=True)}
    reasons = {name: why for name, (_, why) in zip(probes, results, strict=True) if why}
    return statuses, reasons


async def _ping(target: Pingable, timeout: float) -> tuple[str, str | None]:
    try:
        await asyncio.wait_for(target.ping(), timeout)
    except Exception as exc:  # every failure is an answer here
        return "down", f"{type(exc).__name__}: {exc}"
    return "ok", None
