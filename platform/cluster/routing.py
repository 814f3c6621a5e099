"""Adapter- and prefix-aware routing over engine replicas (pure: no I/O, no clock).

Policy of :class:`AffinityRouter`, for a request naming adapter ``a`` (``None`` = base):

1. **Affinity.** Engines where ``a`` is resident on the GPU (reported, or placed there by
   this router within ``placement_ttl``) and that have room are preferred; among them the
   one holding the longest cached prefix of the prompt, then the least loaded.
2. **Placement.** A cold adapter goes to the first engine with room in its rendezvous
   order (highest-random-weight hashing of ``a`` with each engine id), so each adapter
   lives on few replicas and keeps its home when other engines join or leave.
3. **Bounded load.** An engine *has room* while its queue (outstanding requests past its
   batch capacity) is under ``queue_threshold``, or while its load is within
   ``load_factor`` × the fleet's mean load (so a saturated fleet, where every queue is
   long, still keeps adapters home; bounded-load consistent hashing). When every engine holding ``a`` is past
   it, the request spills to the next engine in ``a``'s rendezvous order, which loads
   ``a`` too: a hot adapter is replicated onto more engines instead of being swapped in and
   out of one engine's slots. Replicas then share its traffic by load (rule 1).
   The least-loaded engine always has room by this rule, so a request always lands.

Base-model requests skip the adapter rules: longest cached prefix with room, else least
loaded. :class:`RoundRobinRouter` and :class:`LeastLoadedRouter` are the baselines the
benchmark compares against; all three share the :class:`Router` interface.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from loramux.platform.cluster.protocol import EngineRecord


class NoEngineAvailable(RuntimeError):
    """No live engine can take the request (all gone, or all excluded by retries)."""


@dataclass(frozen=True)
class RouteDecision:
    engine_id: str
    reason: str
    """``affinity`` | ``placement`` | ``spill`` | ``base`` | a baseline's name."""


@dataclass(frozen=True)
class RouterConfig:
    queue_threshold: int = 4
    """Outstanding requests past an engine's capacity before it counts as full (spill-over)."""
    load_factor: float = 1.25
    """An engine past ``queue_threshold`` still has room up to this multiple of the mean load."""
    placement_ttl: float = 5.0
    """Seconds a placement made by this router counts as residency before a heartbeat
    confirms it (a few heartbeat intervals)."""
    prefix_chunk_chars: int = 256
    max_prefix_chunks: int = 16

    def __post_init__(self):
        if self.queue_threshold < 0:
            raise ValueError(f"queue_threshold must be >= 0, got {self.queue_threshold}")
        if self.load_factor < 1.0:
            raise ValueError(f"load_factor must be >= 1, got {self.load_factor}")
        if self.placement_ttl < 0:
            raise ValueError(f"placement_ttl must be >= 0, got {self.placement_ttl}")
        if self.prefix_chunk_chars < 1 or self.max_prefix_chunks < 1:
            raise ValueError("prefix_chunk_chars and max_prefix_chunks must be >= 1")


def rendezvous_score(key: str, engine_id: str) -> int:
    """Highest-random-weight score of ``key`` on ``engine_id`` (stable across processes)."""
    digest = hashlib.blake2b(f"{key}\x00{engine_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def rendezvous_order(key: str, engine_ids: Iterable[str]) -> list[str]:
    """Engines in ``key``'s preference order: the first is its home."""
    return sorted(engine_ids, key=lambda e: rendezvous_score(key, e), reverse=True)


def prefix_hashes(adapter_id: str | None, text: str, *, chunk_chars: int = 256,
                  max_chunks: int = 16) -> list[str]:
    """Chained hashes of the prompt's full ``chunk_chars`` chunks, adapter included.

    Gateways compute them for routing; engines publish the ones they served recently.
    The chain makes hash ``i`` stand for the whole prefix up to chunk ``i``.
    """
    out: list[str] = []
    h = hashlib.blake2b(f"adapter:{adapter_id or ''}".encode(), digest_size=12)
    for i in range(min(len(text) // chunk_chars, max_chunks)):
        h = h.copy()
        h.update(text[i * chunk_chars:(i + 1) * chunk_chars].encode())
        out.append(h.hexdigest())
    return out


def cached_prefix_len(prefixes: Sequence[str], cached: frozenset[str]) -> int:
    """How many leading chunks of the prompt the engine has cached."""
    n = 0
    for p in prefixes:
        if p not in cached:
            break
        n += 1
    return n


class Router(Protocol):
    """Chooses an engine for one request. Called by the gateway once per attempt;
    ``exclude`` holds engines that already failed this request."""

    def route(self, adapter_id: str | None, engines: Sequence[EngineRecord], *,
              prefixes: Sequence[str] = (), exclude: Iterable[str] = (),
              now: float = 0.0) -> RouteDecision: ...


def _candidates(engines: Sequence[EngineRecord], exclude: Iterable[str]) -> list[EngineRecord]:
    excluded = set(exclude)
    out = [e for e in engines if e.engine_id not in excluded]
    if not out:
        raise NoEngineAvailable("no live engine can take the request")
    return out


@dataclass
class AffinityRouter:
    """The cluster's router (policy in the module docstring).

    ``engines`` passed to :meth:`route` must already reflect requests this gateway has
    sent since the last heartbeat (the pool adds its in-flight counts)."""

    config: RouterConfig = field(default_factory=RouterConfig)
    _placed: dict[tuple[str, str], float] = field(default_factory=dict, repr=False)

    def has_room(self, e: EngineRecord, mean_load: float = 0.0) -> bool:
        """Below the queue threshold, or within ``load_factor`` of the mean (one more
        request counted, so a lone busy engine is not always "within" its own mean)."""
        c = self.config
        return (e.load - e.capacity < c.queue_threshold
                or e.load + 1 <= c.load_factor * (mean_load + 1))

    def holders(self, adapter_id: str, engines: Sequence[EngineRecord], now: float) -> list[EngineRecord]:
        """Engines where ``adapter_id`` is resident or was placed within ``placement_ttl``."""
        ttl = self.config.placement_ttl
        return [e for e in engines if adapter_id in e.resident
                or now - self._placed.get((adapter_id, e.engine_id), float("-inf")) <= ttl]

    def route(self, adapter_id, engines, *, prefixes=(), exclude=(), now=0.0) -> RouteDecision:
        cands = _candidates(engines, exclude)
        best_prefix = lambda e: (-cached_prefix_len(prefixes, e.prefixes), e.load, e.engine_id)  # noqa: E731
        mean = sum(e.load for e in cands) / len(cands)
        with_room = [e for e in cands if self.has_room(e, mean)]
        if adapter_id is None:
            pick = min(with_room or cands, key=best_prefix)
            return RouteDecision(pick.engine_id, "base")
        holders = self.holders(adapter_id, cands, now)
        roomy_holders = [e for e in holders if self.has_room(e, mean)]
        if roomy_holders:
            return RouteDecision(min(roomy_holders, key=best_prefix).engine_id, "affinity")
        roomy = {e.engine_id for e in with_room}  # never empty: the least loaded has room
        eid = next(e for e in rendezvous_order(adapter_id, roomy))
        self._placed[(adapter_id, eid)] = now
        self._forget_old(now)
        return RouteDecision(eid, "spill" if holders else "placement")

    def _forget_old(self, now: float) -> None:
        if len(self._placed) > 4096:
            ttl = self.config.placement_ttl
            self._placed = {k: t for k, t in self._placed.items() if now - t <= ttl}


@dataclass
class RoundRobinRouter:
    """Baseline: engines in turn, blind to adapters and load."""

    _counter: itertools.count = field(default_factory=itertools.count, repr=False)

    def route(self, adapter_id, engines, *, prefixes=(), exclude=(), now=0.0) -> RouteDecision:
        cands = sorted(_candidates(engines, exclude), key=lambda e: e.engine_id)
        return RouteDecision(cands[next(self._counter) % len(cands)].engine_id, "round_robin")


@dataclass
class LeastLoadedRouter:
    """Baseline: the engine with the fewest outstanding requests, blind to adapters."""

    def route(self, adapter_id, engines, *, prefixes=(), exclude=(), now=0.0) -> RouteDecision:
        pick = min(_candidates(engines, exclude), key=lambda e: (e.load, e.engine_id))
        return RouteDecision(pick.engine_id, "least_loaded")
