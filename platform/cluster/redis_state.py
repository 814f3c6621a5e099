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

import time
from collections.abc import Callable
from dataclasses import dataclass

import redis

from loramux.platform.cluster.heartbeat import EventSubscription
from loramux.platform.cluster.protocol import REPLY_TTL_S, ActionReply, ClusterEvent, EngineRecord
from loramux.platform.settings import setting_default


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
