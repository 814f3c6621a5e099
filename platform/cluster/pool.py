"""The gateway's view of live engines: heartbeats in, expiry by TTL, local in-flight counts.

Pure (the caller passes ``now``). A gateway calls :meth:`EnginePool.heartbeat` for every
engine record it reads from Redis, :meth:`EnginePool.live` before each routing decision,
and :meth:`EnginePool.started` / :meth:`EnginePool.finished` around each proxied request,
so routing sees its own requests before the engine's next heartbeat reports them.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from loramux.platform.cluster.protocol import EngineRecord
from loramux.platform.settings import setting_default


@dataclass
class EnginePool:
    ttl: float = setting_default("heartbeat_ttl")
    """Seconds without a heartbeat after which an engine leaves the pool."""
    _views: dict[str, EngineRecord] = field(default_factory=dict)
    _seen: dict[str, float] = field(default_factory=dict)
    _inflight: dict[str, int] = field(default_factory=dict)

    def __post_init__(self):
        if self.ttl <= 0:
            raise ValueError(f"ttl must be > 0, got {self.ttl}")

    def heartbeat(self, view: EngineRecord, seen_at: float) -> None:
        """Record an engine's state as of ``seen_at`` (an older record never wins)."""
        if seen_at >= self._seen.get(view.engine_id, float("-inf")):
            self._views[view.engine_id] = view
            self._seen[view.engine_id] = seen_at

    def remove(self, engine_id: str) -> None:
        """Drop an engine at once (it deregistered, or a request to it failed to connect)."""
        self._views.pop(engine_id, None)
        self._seen.pop(engine_id, None)

    def expire(self, now: float) -> list[str]:
        """Drop engines whose last heartbeat is older than ``ttl``; returns their ids."""
        gone = [eid for eid, t in self._seen.items() if now - t > self.ttl]
        for eid in gone:
            self.remove(eid)
        return gone

    def live(self, now: float) -> list[EngineRecord]:
        """Live engines, each with this gateway's in-flight requests folded into its load."""
        self.expire(now)
        out = []
        for eid, v in sorted(self._views.items()):
            mine = self._inflight.get(eid, 0)
            if mine > v.load:  # requests the engine has not reported yet
                v = replace(v, waiting=v.waiting + mine - v.load)
            out.append(v)
        return out

    def get(self, engine_id: str) -> EngineRecord | None:
        return self._views.get(engine_id)

    def started(self, engine_id: str) -> None:
        self._inflight[engine_id] = self._inflight.get(engine_id, 0) + 1

    def finished(self, engine_id: str) -> None:
        n = self._inflight.get(engine_id, 0) - 1
        if n > 0:
            self._inflight[engine_id] = n
        else:
            self._inflight.pop(engine_id, None)

    def note_resident(self, engine_id: str, adapter_id: str) -> None:
        """An engine confirmed (e.g. in a response) that it now holds ``adapter_id``."""
        v = self._views.get(engine_id)
        if v is not None and adapter_id not in v.resident:
            self._views[engine_id] = replace(v, resident=v.resident | {adapter_id})

    def note_evicted(self, adapter_id: str) -> None:
        """An evict fan-out: ``adapter_id`` is resident nowhere until heartbeats say so."""
        for eid, v in self._views.items():
            if adapter_id in v.resident:
                self._views[eid] = replace(v, resident=v.resident - {adapter_id})
