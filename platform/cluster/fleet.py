"""The admin :class:`~loramux.platform.admin.fleet.Fleet` of a gateway: every engine from
its Redis heartbeat record, and each action published to one engine (by id) or to all,
answered by each acting engine through a Redis reply list."""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING

from starlette.concurrency import run_in_threadpool

from loramux.platform.admin.fleet import EngineView, Outcome
from loramux.platform.admin.schemas import EngineSummary
from loramux.platform.cluster.state import ClusterEvent, ClusterState, EngineRecord
from loramux.platform.errors import NotFound, ServiceUnavailable

if TYPE_CHECKING:
    from loramux.engine.lora_request import LoRARequest

ACTION_TIMEOUT_S = 35.0
"""How long an action waits for the engines' replies (engines give up on theirs at 30 s)."""


def engine_view(rec: EngineRecord) -> EngineView:
    """One engine's dashboard view from its heartbeat record (GPU and CPU residency)."""
    rows = [{"name": k, "tier": "gpu"} for k in sorted(rec.resident)]
    rows += [{"name": k, "tier": "cpu"} for k in sorted(set(rec.cpu_resident) - set(rec.resident))]
    summary = EngineSummary(
        id=rec.engine_id, role="engine", running=rec.running, waiting=rec.waiting,
        kv_cache_usage=rec.kv_usage, num_preemptions=0, max_loras=rec.max_loras,
        slots_used=len(rec.resident), cpu_used=len(rows), evictions=0,
        lora_enabled=rec.max_loras > 0, healthy=True)
    return EngineView(summary, rows)


class ClusterFleet:
    """The engines registered in one Redis namespace (``--role gateway``)."""

    def __init__(self, cluster: ClusterState, *, origin: str,
                 timeout: float = ACTION_TIMEOUT_S) -> None:
        self.cluster = cluster
        self.origin = origin
        self.timeout = timeout

    async def _records(self) -> list[EngineRecord]:
        try:
            return await run_in_threadpool(self.cluster.read_engines)
        except Exception as e:
            raise ServiceUnavailable(f"cannot read the engines from Redis: {e}",
                                     code="engine_dead") from None

    async def engines(self) -> list[EngineView]:
        records = await self._records()
        if not records:
            raise ServiceUnavailable("no engine is registered", code="engine_dead")
        return [engine_view(r) for r in records]

    def knows(self, view: EngineView, key: str) -> bool:
        """Always: each engine resolves the key through the shared registry itself."""
        return True

    async def act(self, engine_id: str | None, action: str, key: str,
                  request: LoRARequest | None) -> list[Outcome]:
        ids = [r.engine_id for r in await self._records()]
        if engine_id:
            if engine_id not in ids:
                raise NotFound(f"no engine {engine_id!r}; live: {', '.join(ids) or 'none'}",
                               code="engine_not_found")
            ids = [engine_id]
        reply_to = f"{self.cluster.namespace}:reply:{uuid.uuid4().hex}"
        ev = ClusterEvent(action, adapter_id=key, origin=self.origin,
                          target=engine_id or None, reply_to=reply_to)
        try:
            await run_in_threadpool(self.cluster.publish_event, ev)
            replies = await run_in_threadpool(self.cluster.wait_replies, reply_to, len(ids),
                                              self.timeout)
        except Exception as e:
            raise ServiceUnavailable(f"cannot reach Redis to send {action}: {e}") from None
        got = {r.engine_id: r for r in replies}
        errors = [f"{r.engine_id}: {r.error}" for r in replies if r.error]
        if errors and len(errors) == len(ids):
            raise ValueError("; ".join(errors))
        return [Outcome(i, got[i].done, got[i].deferred) if i in got else Outcome(i, False)
                for i in ids]
