"""The gateway's view of the engine pool, refreshed from Redis, and kept (frozen) while
Redis is unreachable."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import redis

from loramux.platform.cluster.heartbeat import Periodic
from loramux.platform.cluster.pool import EnginePool
from loramux.platform.cluster.protocol import EngineRecord
from loramux.platform.cluster.redis_state import ClusterState

logger = logging.getLogger(__name__)


@dataclass
class GatewayView:
    """Gateway side: the live-engine pool, refreshed from Redis.

    While Redis answers, the pool holds exactly the registered engines (minus ones this
    gateway saw fail within the last ``ttl``). While it does not, the last known view
    stays (no expiry) and :attr:`degraded` is true (``/ready`` and the logs say so)."""

    state: ClusterState
    pool: EnginePool = field(default_factory=EnginePool)
    clock: Callable[[], float] = time.monotonic
    degraded: bool = False
    last_ok: float | None = None
    last_error: str = ""
    _failed: dict[str, float] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def refresh(self) -> bool:
        """Read the engines from Redis into the pool; False (and degraded) on a Redis error."""
        try:
            records = self.state.read_engines()
        except redis.RedisError as e:
            if not self.degraded:
                logger.warning("gateway: Redis unavailable (%s); routing on the last known "
                               "view of %d engine(s)", e, len(self.pool.live(self._frozen_now())))
            self.degraded, self.last_error = True, str(e)
            return False
        now = self.clock()
        with self._lock:
            present = set()
            for rec in records:
                failed_at = self._failed.get(rec.engine_id)
                if failed_at is not None and now - failed_at < self.state.ttl:
                    continue
                self._failed.pop(rec.engine_id, None)
                self.pool.heartbeat(rec, now)
                present.add(rec.engine_id)
            for v in self.pool.live(now):
                if v.engine_id not in present:
                    self.pool.remove(v.engine_id)
        if self.degraded:
            logger.info("gateway: Redis is back; %d engine(s) live", len(present))
        self.degraded, self.last_ok, self.last_error = False, now, ""
        return True

    def start(self, interval: float) -> Periodic:
        """Refresh now and then every ``interval`` seconds; the caller stops the ticker."""
        self.refresh()
        return Periodic(self.refresh, interval, "gateway-view").start()

    def _frozen_now(self) -> float:
        return self.last_ok if self.last_ok is not None else self.clock()

    def live(self) -> list[EngineRecord]:
        """Engines to route over now (frozen at the last good read while degraded)."""
        with self._lock:
            return self.pool.live(self._frozen_now() if self.degraded else self.clock())

    def mark_failed(self, engine_id: str) -> None:
        """A request to this engine failed to connect: out of the pool until it beats
        again after ``ttl`` (or re-registers)."""
        with self._lock:
            self._failed[engine_id] = self.clock()
            self.pool.remove(engine_id)
