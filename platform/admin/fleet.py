"""The fleet view: every engine the dashboard shows and acts on.

The admin service talks to a :class:`Fleet`, never to an engine directly. All-in-one
(``--role all``) has :class:`LocalFleet`: one engine in this process. A cluster
implementation (gateway role) lists the engines from their heartbeats (each with the
numbers below and its residency rows) and sends each action to one engine or to every
engine over the command channel, answering with what each engine did; nothing else in
``admin/`` changes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from loramux.platform.admin.schemas import EngineSummary
from loramux.platform.errors import NotFound, ServiceUnavailable

if TYPE_CHECKING:
    from loramux.engine.async_engine import AsyncEngine
    from loramux.engine.lora_request import LoRARequest
    from loramux.platform.admin.activity import Activity

WARM_TIMEOUT_S = 120.0
"""How long ``warm`` / ``pin`` wait for an adapter's background load."""


@dataclass
class FleetEngine:
    """One engine as of one moment: its numbers and its adapters' residency rows."""

    summary: EngineSummary
    rows: list[dict] = field(default_factory=list)
    evict_pending: set[str] = field(default_factory=set)


@dataclass
class Outcome:
    """What one engine did with one action."""

    engine: str
    done: bool
    deferred: bool = False


class Fleet(Protocol):
    """The engines behind this server."""

    async def engines(self) -> list[FleetEngine]: ...

    async def act(self, engine_id: str | None, action: str, key: str,
                  request: LoRARequest | None) -> list[Outcome]:
        """Run ``action`` on one engine (``engine_id``) or all (None). ``request``
        registers an adapter an engine does not know yet (None: it must know it)."""
        ...

    def knows(self, view: FleetEngine, key: str) -> bool: ...


class LocalFleet:
    """One engine in this process (``--role all``)."""

    engine_id = "local"

    def __init__(self, engine: AsyncEngine, activity: Activity) -> None:
        self.engine = engine
        self.activity = activity
        self.evict_pending: set[str] = set()
        self.remove_listener = engine.add_adapter_listener(self._on_adapter_event)

    def _on_adapter_event(self, event: str, key: str) -> None:
        if event in ("evicted", "dropped"):
            self.evict_pending.discard(key)

    def _check(self, engine_id: str | None) -> None:
        if not self.engine.is_ready:
            raise ServiceUnavailable("the engine is not running", code="engine_dead")
        if engine_id not in (None, "", self.engine_id):
            raise NotFound(f"no engine {engine_id!r}; this server runs one engine, "
                           f"{self.engine_id!r}", code="engine_not_found")

    async def engines(self) -> list[FleetEngine]:
        self._check(None)
        snap = await self.engine.lora_snapshot()
        stats = self.engine.stats()
        summary = EngineSummary(
            id=self.engine_id, role="all", running=stats.num_running,
            waiting=stats.num_waiting, kv_cache_usage=stats.kv_cache_usage,
            num_preemptions=stats.num_preemptions, max_loras=snap.max_loras,
            slots_used=sum(1 for r in snap.rows if r["slot"] is not None),
            max_cpu_loras=snap.max_cpu_loras,
            cpu_used=sum(1 for r in snap.rows if r["tier"] in ("cpu", "gpu", "device")),
            evictions=snap.num_evictions, lora_enabled=snap.lora_enabled,
            adapter_loads=snap.load_stats,
            prefix_cache_hit_rate=stats.prefix_cache_hit_rate,
            tokens_per_s=self.activity.tokens_per_s(), healthy=self.engine.is_ready,
            cpu_kernels=stats.cpu_kernels, cpu_kernels_reason=stats.cpu_kernels_reason,
        )
        return [FleetEngine(summary, list(snap.rows), set(self.evict_pending))]

    def knows(self, view: FleetEngine, key: str) -> bool:
        return any(r["name"] == key for r in view.rows)

    async def act(self, engine_id: str | None, action: str, key: str,
                  request: LoRARequest | None) -> list[Outcome]:
        self._check(engine_id)
        if request is not None:
            if action in ("evict", "unpin"):
                return [Outcome(self.engine_id, False)]
            await self.engine.register_adapter(request)
        if action == "evict":
            done, deferred = await self.engine.evict_adapter(key)
            if deferred:
                self.evict_pending.add(key)
            return [Outcome(self.engine_id, done, deferred)]
        if action == "unpin":
            await self.engine.unpin_adapter(key)
            return [Outcome(self.engine_id, True)]
        if action == "pin":
            await self.engine.pin_adapter(key)
            await self.engine.warm_adapter(key, WARM_TIMEOUT_S)
            return [Outcome(self.engine_id, True)]
        return [Outcome(self.engine_id, await self.engine.warm_adapter(key, WARM_TIMEOUT_S))]
