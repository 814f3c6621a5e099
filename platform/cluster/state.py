"""Cluster state in Redis: engine registrations with a heartbeat TTL, and the fan-out of
admin actions and registry events over pub/sub.

Keys (all under one namespace, ``loramux`` by default, so tests and several clusters can
share one Redis):

    {ns}:engines            set of engine ids ever registered (pruned as keys expire)
    {ns}:engine:{id}        JSON :class:`EngineRecord`, expires ``ttl`` seconds after its
                            last heartbeat: an engine that stops beating leaves the pool
    {ns}:events             pub/sub channel of :class:`ClusterEvent` JSON messages

:class:`ClusterState` is the thin Redis layer (every call may raise ``redis.RedisError``);
:class:`EngineHeartbeat` (engine side) and :class:`~.view.GatewayView` (gateway side) run on it and
survive Redis outages: the engine keeps serving and re-registers when Redis is back, the
gateway keeps routing on its last known view and reports itself degraded.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Self

import redis

from loramux.platform.cluster.routing import EngineView
from loramux.platform.settings import setting_default

logger = logging.getLogger(__name__)

EVENT_KINDS = frozenset({"evict", "pin", "unpin", "warm", "adapter_deleted", "adapter_replaced",
                         "key_revoked"})


@dataclass(frozen=True)
class EngineRecord:
    """What an engine publishes at each heartbeat."""

    engine_id: str
    url: str
    capacity: int
    max_loras: int
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    resident: tuple[str, ...] = ()
    """Adapter ids in GPU slots."""
    cpu_resident: tuple[str, ...] = ()
    prefixes: tuple[str, ...] = ()
    """Recently served prompt-prefix hashes (``routing.prefix_hashes``), newest last."""
    models: tuple[str, ...] = ()
    """Names served without a registry lookup: the base model's, then static adapters'."""
    static: tuple[str, ...] = ()
    """Which of ``models`` are static adapters (``--lora-modules``)."""
    started_at: float = 0.0

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, raw: str | bytes) -> EngineRecord:
        d = json.loads(raw)
        for k in ("resident", "cpu_resident", "prefixes", "models", "static"):
            d[k] = tuple(d.get(k, ()))
        return cls(**{k: v for k, v in d.items() if k in cls.__dataclass_fields__})

    def view(self) -> EngineView:
        return EngineView(self.engine_id, url=self.url, capacity=self.capacity,
                          max_loras=self.max_loras, running=self.running, waiting=self.waiting,
                          kv_usage=self.kv_usage, resident=frozenset(self.resident),
                          cpu_resident=frozenset(self.cpu_resident),
                          prefixes=frozenset(self.prefixes))


class JsonMessage:
    """A dataclass sent through Redis as JSON (unknown fields are ignored on reading)."""

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, raw: str | bytes) -> Self:
        d = json.loads(raw)
        return cls(**{k: v for k, v in d.items() if k in cls.__dataclass_fields__})


@dataclass(frozen=True)
class ClusterEvent(JsonMessage):
    """One fan-out message. ``kind`` in :data:`EVENT_KINDS`; ``adapter_id`` for adapter
    events (the engine-side adapter id), ``key_id`` for ``key_revoked``."""

    kind: str
    adapter_id: str | None = None
    tenant_id: str | None = None
    name: str | None = None
    """The adapter's name within its tenant (registry events)."""
    key_id: str | None = None
    origin: str = ""
    """Who published it (a gateway or engine id); subscribers may skip their own."""
    target: str | None = None
    """Admin actions: the one engine id meant (None: every engine)."""
    reply_to: str | None = None
    """Admin actions: a Redis list each acting engine pushes its :class:`ActionReply` to."""

    def __post_init__(self):
        if self.kind not in EVENT_KINDS:
            raise ValueError(f"unknown cluster event kind {self.kind!r}; one of {sorted(EVENT_KINDS)}")


@dataclass(frozen=True)
class ActionReply(JsonMessage):
    """What one engine did with a fanned-out admin action."""

    engine_id: str
    done: bool
    deferred: bool = False
    error: str | None = None


REPLY_TTL_S = 60


@dataclass
class ClusterState:
    """Engine records and events in one Redis namespace. Every method talks to Redis."""

    client: redis.Redis
    namespace: str = setting_default("redis_namespace")
    ttl: float = setting_default("heartbeat_ttl")
    """Seconds an engine record lives without a heartbeat."""

    def _key(self, engine_id: str) -> str:
        return f"{self.namespace}:engine:{engine_id}"

    @property
    def channel(self) -> str:
        return f"{self.namespace}:events"

    def publish_engine(self, record: EngineRecord) -> None:
        """Register or refresh an engine (called at every heartbeat)."""
        pipe = self.client.pipeline()
        pipe.set(self._key(record.engine_id), record.to_json(), px=int(self.ttl * 1000))
        pipe.sadd(f"{self.namespace}:engines", record.engine_id)
        pipe.execute()

    def remove_engine(self, engine_id: str) -> None:
        """Deregister at once (graceful shutdown)."""
        pipe = self.client.pipeline()
        pipe.delete(self._key(engine_id))
        pipe.srem(f"{self.namespace}:engines", engine_id)
        pipe.execute()

    def read_engines(self) -> list[EngineRecord]:
        """Every engine whose record has not expired (expired ids are pruned)."""
        ids = sorted(m.decode() if isinstance(m, bytes) else m
                     for m in self.client.smembers(f"{self.namespace}:engines"))
        if not ids:
            return []
        raws = self.client.mget([self._key(i) for i in ids])
        gone = [i for i, raw in zip(ids, raws, strict=True) if raw is None]
        if gone:
            self.client.srem(f"{self.namespace}:engines", *gone)
        return [EngineRecord.from_json(raw) for raw in raws if raw is not None]

    def publish_event(self, event: ClusterEvent) -> int:
        """Send to every subscriber; returns how many received it."""
        return int(self.client.publish(self.channel, event.to_json()))

    def push_reply(self, reply_to: str, reply: ActionReply) -> None:
        """Answer an admin action (engine side); the list expires unread after a minute."""
        pipe = self.client.pipeline()
        pipe.rpush(reply_to, reply.to_json())
        pipe.expire(reply_to, REPLY_TTL_S)
        pipe.execute()

    def wait_replies(self, reply_to: str, count: int, timeout: float) -> list[ActionReply]:
        """Up to ``count`` replies pushed to ``reply_to`` within ``timeout`` seconds."""
        out: list[ActionReply] = []
        deadline = time.monotonic() + timeout
        while len(out) < count:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            got = self.client.blpop([reply_to], timeout=max(left, 0.01))
            if got is not None:
                out.append(ActionReply.from_json(got[1]))
        self.client.delete(reply_to)
        return out

    def subscribe(self, handler: Callable[[ClusterEvent], None], *,
                  name: str = "cluster-events") -> EventSubscription:
        sub = EventSubscription(self, handler, name=name)
        sub.start()
        return sub


@dataclass
class EventSubscription:
    """A daemon thread delivering :class:`ClusterEvent` s to ``handler``; reconnects after
    Redis errors. ``ready`` is set once subscribed (events published before are not seen)."""

    state: ClusterState
    handler: Callable[[ClusterEvent], None]
    name: str = "cluster-events"
    ready: threading.Event = field(default_factory=threading.Event)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
        self._thread.start()

    def close(self, timeout: float = 2.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def _run(self) -> None:
        backoff = 0.1
        while not self._stop.is_set():
            pubsub = self.state.client.pubsub(ignore_subscribe_messages=True)
            try:
                pubsub.subscribe(self.state.channel)
                self.ready.set()
                backoff = 0.1
                while not self._stop.is_set():
                    msg = pubsub.get_message(timeout=0.2)
                    if msg is None or msg.get("type") != "message":
                        continue
                    try:
                        self.handler(ClusterEvent.from_json(msg["data"]))
                    except Exception:
                        logger.exception("cluster event handler failed")
            except redis.RedisError as e:
                self.ready.clear()
                logger.warning("cluster events: Redis unavailable (%s); retrying", e)
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 2.0)
            finally:
                try:
                    pubsub.close()
                except Exception:
                    pass


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
    interval: float = 1.0
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
