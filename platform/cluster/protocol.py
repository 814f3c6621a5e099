"""What gateways and engines say to each other: headers, the gateway's signed identity
token, and the messages that travel through Redis (JSON).

* :class:`EngineRecord` is the one shape of an engine's facts: the engine's heartbeat
  publishes it, the gateway's pool and router read it, the dashboard renders it
  (``EngineSummary.of``).
* :class:`ClusterEvent` is a fan-out message (admin actions, registry changes);
  :class:`ActionReply` is one engine's answer to an action.

Pure data: no I/O here (Redis calls are in :mod:`.redis_state`, threads in :mod:`.heartbeat`).
"""

from __future__ import annotations

import hashlib
import hmac
import json
from dataclasses import asdict, dataclass, fields
from typing import NamedTuple, Self

from loramux.platform.admin.actions import ACTIONS

SECRET_HEADER = "x-loramux-cluster-secret"
"""Carries the cluster secret from gateways to engines; engines refuse requests without it."""
PREFIX_HEADER = "x-loramux-prefixes"
"""Comma-separated prompt-prefix hashes the gateway computed; the engine publishes the
recent ones so later requests sharing the prefix find the engine that cached it."""
ENGINE_HEADER = "X-LoRAMux-Engine"
"""On every proxied response: the engine that served it."""
OPEN_PATHS = ("/health", "/ready", "/metrics")
"""Engine routes served without the cluster secret (probes, scraping)."""
REGISTRY_KINDS = ("adapter_deleted", "adapter_changed", "version_removed", "key_revoked")
"""Registry changes fanned out: an adapter deleted (drop every version), changed (a new
version, a rollout, a preset: forget cached resolutions), one version removed (drop its
engine key), an API key revoked."""
EVENT_KINDS = frozenset(ACTIONS) | frozenset(REGISTRY_KINDS)
REPLY_TTL_S = 60
"""Seconds an unread reply list lives in Redis."""
IDENTITY_PREFIX = "lmxgw."


def identity_mac(secret: str, payload: str) -> str:
    """The MAC of an identity token's payload under the cluster secret."""
    return hmac.new(secret.encode(), payload.encode(), hashlib.sha256).hexdigest()[:32]


class Identity(NamedTuple):
    """Who a gateway vouches for."""

    tenant_id: int | None
    is_admin: bool
    key_prefix: str | None = None
    """The public prefix of the client's API key (usage records)."""


def identity_token(secret: str, tenant_id: int | None, is_admin: bool,
                   key_prefix: str | None = None) -> str:
    """The bearer token a gateway sends an engine for an authenticated caller
    (``lmxgw.<tenant id>.<admin>[.<key prefix>].<mac>``)."""
    payload = f"{'' if tenant_id is None else tenant_id}.{int(is_admin)}"
    if key_prefix:
        payload += f".{key_prefix}"
    return f"{IDENTITY_PREFIX}{payload}.{identity_mac(secret, payload)}"


def read_identity(secret: str, token: str | None) -> Identity | None:
    """The :class:`Identity` of a valid identity token, else None."""
    if token is None or not token.startswith(IDENTITY_PREFIX):
        return None
    payload, _, mac = token[len(IDENTITY_PREFIX):].rpartition(".")
    if not hmac.compare_digest(mac, identity_mac(secret, payload)):
        return None
    tid, _, rest = payload.partition(".")
    admin, _, prefix = rest.partition(".")
    return Identity(int(tid) if tid else None, admin == "1", prefix or None)


_SETS = ("resident", "cpu_resident", "prefixes")
_TUPLES = ("models", "static")


@dataclass(frozen=True)
class EngineRecord:
    """One engine's facts as of its last heartbeat."""

    engine_id: str
    url: str = ""
    capacity: int = 1
    """Requests the engine runs at once (its ``max_num_seqs``); more wait in its queue."""
    max_loras: int = 1
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    """Fraction of KV-cache blocks in use, 0..1."""
    resident: frozenset[str] = frozenset()
    """Adapter ids in GPU slots."""
    cpu_resident: frozenset[str] = frozenset()
    """Adapter ids in the CPU tier (one copy away from a slot)."""
    prefixes: frozenset[str] = frozenset()
    """Recently cached prompt-prefix hashes (``routing.prefix_hashes``)."""
    models: tuple[str, ...] = ()
    """Names served without a registry lookup: the base model's, then static adapters'."""
    static: tuple[str, ...] = ()
    """Which of ``models`` are static adapters (``--lora-modules``)."""
    prefix_cache_hit_rate: float | None = None
    """Fraction of looked-up prompt blocks found in the engine's prefix cache."""
    started_at: float = 0.0

    def __post_init__(self) -> None:
        for name in _SETS:  # callers may pass any iterable
            value = getattr(self, name)
            if not isinstance(value, frozenset):
                object.__setattr__(self, name, frozenset(value))
        for name in _TUPLES:
            object.__setattr__(self, name, tuple(getattr(self, name)))

    @property
    def load(self) -> int:
        """Requests running and waiting."""
        return self.running + self.waiting

    def to_json(self) -> str:
        d = asdict(self)
        for name in _SETS:
            d[name] = sorted(d[name])
        return json.dumps(d)

    @classmethod
    def from_json(cls, raw: str | bytes) -> EngineRecord:
        d = json.loads(raw)
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})


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
    events (the engine key of the version concerned), ``key_id`` for ``key_revoked``."""

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
