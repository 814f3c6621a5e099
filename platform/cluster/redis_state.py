"""The cluster's Redis calls: engine records with a heartbeat TTL, the fan-out of admin
actions and registry events over pub/sub, and the reply lists of admin actions.

Keys (all under one namespace, ``loramux`` by default, so tests and several clusters can
share one Redis):

    {ns}:engines            set of engine ids ever registered (pruned as keys expire)
    {ns}:engine:{id}        JSON :class:`~.protocol.EngineRecord`, expires ``ttl`` seconds
                            after its last heartbeat: an engine that stops beating leaves
                            the pool (the one expiry; the gateway's pool mirrors it)
    {ns}:events             pub/sub channel of :class:`~.protocol.ClusterEvent` JSON messages
    {ns}:reply:{uuid}       list of :class:`~.protocol.ActionReply` JSON (one admin action)

Every :class:`ClusterState` method talks to Redis and may raise ``redis.RedisError``; the
threads that run on it (:mod:`.heartbeat`) and the gateway's view (:mod:`.view`) survive
outages: the engine keeps serving and re-registers when Redis is back, the gateway keeps
routing on its last known view and reports itself degraded.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import redis

from loramux.platform.cluster.protocol import REPLY_TTL_S, ActionReply, ClusterEvent, EngineRecord
from loramux.platform.settings import setting_default

logger = logging.getLogger(__name__)


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
                  name: str = "cluster-events",
                  on_resubscribe: Callable[[], None] | None = None) -> EventSubscription:
        sub = EventSubscription(self, handler, name=name, on_resubscribe=on_resubscribe)
        sub.start()
        return sub


@dataclass
class EventSubscription:
    """A daemon thread delivering :class:`ClusterEvent` s to ``handler``; reconnects after
    Redis errors. ``ready`` is set once subscribed (events published before are not seen);
    ``on_resubscribe`` runs each time it subscribes again after a failure (events of the
    outage were missed: what was cached on their strength must be forgotten)."""

    state: ClusterState
    handler: Callable[[ClusterEvent], None]
    name: str = "cluster-events"
    on_resubscribe: Callable[[], None] | None = None
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
        failed = False
        while not self._stop.is_set():
            pubsub = self.state.client.pubsub(ignore_subscribe_messages=True)
            try:
                pubsub.subscribe(self.state.channel)
                self.ready.set()
                backoff = 0.1
                if failed and self.on_resubscribe is not None:
                    try:
                        self.on_resubscribe()
                    except Exception:
                        logger.exception("cluster events: the resubscribe hook failed")
                failed = False
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
                failed = True
                logger.warning("cluster events: Redis unavailable (%s); retrying", e)
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 2.0)
            finally:
                try:
                    pubsub.close()
                except Exception:
                    pass
