"""An engine's heartbeat (what it publishes, and when) and :class:`Periodic`, the ticker
under it and the gateway's view (the event subscription every role runs is
:class:`~.redis_state.EventSubscription`).

:func:`read_record` builds an engine's :class:`~.protocol.EngineRecord` from what it
serves (a :class:`HeartbeatSource`: public engine seams only); :class:`RecentPrefixes`
remembers the prompt-prefix hashes of the requests a gateway sent, so the record tells
routers where a prefix is cached.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import redis

from loramux.platform.cluster.protocol import EngineRecord
from loramux.platform.settings import setting_default

if TYPE_CHECKING:
    from loramux.engine.async_engine import AsyncEngine
    from loramux.platform.cluster.redis_state import ClusterState
    from loramux.platform.openai.resolver import ModelResolver
    from loramux.platform.settings import Settings

logger = logging.getLogger(__name__)


class RecentPrefixes:
    """The last ``size`` prefix hashes seen, newest last (thread-safe enough: one deque)."""

    def __init__(self, size: int = 512) -> None:
        self._hashes: collections.deque[str] = collections.deque(maxlen=size)

    def add(self, hashes: list[str]) -> None:
        for h in hashes:
            if h:
                self._hashes.append(h)

    def snapshot(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(reversed(self._hashes)))[::-1]


class HeartbeatSource(Protocol):
    """What a heartbeat reads of the server it describes (an all-in-one app's state)."""

    settings: Settings
    engine: AsyncEngine
    resolver: ModelResolver


def read_record(state: HeartbeatSource, *, engine_id: str, url: str, started_at: float,
                prefixes: tuple[str, ...] = ()) -> EngineRecord:
    """The heartbeat of one engine, read from its app state (called from the heartbeat
    thread): load from ``AsyncEngine.stats``, residency from ``AsyncEngine.lora_snapshot``
    (taken on the engine thread)."""
    eng = state.engine
    stats = eng.stats()
    rows: list[dict] = []
    max_loras = 0
    if eng.is_ready:
        snap = asyncio.run(asyncio.wait_for(eng.lora_snapshot(), 5))
        rows, max_loras = snap.rows, snap.max_loras
    resident = frozenset(r["name"] for r in rows if r["tier"] in ("gpu", "device"))
    cpu = frozenset(r["name"] for r in rows if r["tier"] == "cpu")
    static = tuple(state.resolver.static)
    return EngineRecord(
        engine_id, url=url, capacity=state.settings.max_num_seqs, max_loras=max_loras,
        running=stats.num_running, waiting=stats.num_waiting, kv_usage=stats.kv_cache_usage,
        resident=resident, cpu_resident=cpu, models=(*state.resolver.base_names, *static),
        static=static, prefixes=frozenset(prefixes),
        prefix_cache_hit_rate=stats.prefix_cache_hit_rate, started_at=started_at)


@dataclass
class Periodic:
    """Calls ``fn`` every ``interval`` seconds on a daemon thread until :meth:`stop`."""

    fn: Callable[[], object]
    interval: float
    name: str
    _stop: threading.Event = field(default_factory=threading.Event)
    _wake: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> Periodic:
        self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
        self._thread.start()
        return self

    def wake(self) -> None:
        """Run ``fn`` now instead of at the end of the current interval."""
        self._wake.set()

    def _run(self) -> None:
        while True:
            self._wake.wait(self.interval)
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                self.fn()
            except Exception:
                logger.exception("%s failed", self.name)

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(self.interval + 1)


@dataclass
class EngineHeartbeat:
    """Engine side: publishes ``snapshot()`` every ``interval`` seconds from a thread.
    Redis errors are logged and retried: the engine keeps serving, and re-registers (a
    fresh record) as soon as Redis answers again."""

    state: ClusterState
    snapshot: Callable[[], EngineRecord]
    interval: float = setting_default("heartbeat_interval")
    ok: bool = False
    _ticker: Periodic | None = None

    def beat(self) -> bool:
        try:
            self.state.publish_engine(self.snapshot())
        except redis.RedisError as e:
            if self.ok:
                logger.warning("heartbeat: Redis unavailable (%s); serving on, retrying", e)
            self.ok = False
            return False
        if not self.ok:
            logger.info("heartbeat: registered in Redis")
        self.ok = True
        return True

    def start(self) -> None:
        self.beat()
        self._ticker = Periodic(self.beat, self.interval, "engine-heartbeat").start()

    def wake(self) -> None:
        """Beat now (the residency changed); safe from any thread, a no-op before start."""
        if self._ticker is not None:
            self._ticker.wake()

    def stop(self, engine_id: str | None = None) -> None:
        """Stop beating; with ``engine_id`` also deregister (best effort)."""
        if self._ticker is not None:
            self._ticker.stop()
        if engine_id is not None:
            try:
                self.state.remove_engine(engine_id)
            except redis.RedisError:
                pass
