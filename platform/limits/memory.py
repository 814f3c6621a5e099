"""The in-process limit backend: the semantics of ``backend.py`` in one process's memory
(``loramux serve`` without ``--redis-url``). Thread-safe; every call is atomic."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from loramux.platform.limits.backend import Ask, Decision, bucket_level, bucket_wait_s


@dataclass
class _Key:
    buckets: dict[str, tuple[float, float]] = field(default_factory=dict)  # name → (level, t)
    leases: dict[str, tuple[float, int]] = field(default_factory=dict)  # id → (expiry, seqs)

    def level(self, name: str, capacity: int, now: float) -> float:
        if name not in self.buckets:
            return float(capacity)
        level, at = self.buckets[name]
        return bucket_level(level, capacity, now - at)

    def purge(self, now: float) -> None:
        for lease in [k for k, (expiry, _) in self.leases.items() if expiry <= now]:
            del self.leases[lease]


class InProcessBackend:
    """Limits kept in a dict. ``clock`` (seconds, monotonic) is injectable for tests."""

    dependency = None  # nothing outside the process: /ready does not list it

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._keys: dict[str, _Key] = {}

    async def acquire(self, key: str, ask: Ask) -> Decision:
        with self._lock:
            now = self._clock()
            state = self._keys.setdefault(key, _Key())
            state.purge(now)
            denied: list[tuple[str, float]] = []
            conc = ask.max_concurrent_requests
            if conc is not None and len(state.leases) + 1 > conc:
                denied.append(("max_concurrent_requests", ask.busy_retry_after_s))
            seqs = ask.max_queued_sequences
            if seqs is not None and sum(s for _, s in state.leases.values()) + ask.sequences > seqs:
                denied.append(("max_queued_sequences", ask.busy_retry_after_s))
            rpm, tpm = ask.requests_per_minute, ask.tokens_per_minute
            if rpm is not None:
                r = state.level("r", rpm, now)
                if r < 1:
                    denied.append(("requests_per_minute", bucket_wait_s(r, 1, rpm)))
            if tpm is not None:
                t = state.level("t", tpm, now)
                need = min(ask.tokens, tpm)
                if t < need:
                    denied.append(("tokens_per_minute", bucket_wait_s(t, need, tpm)))
            if denied:
                return Decision(False, denied[0][0], max(w for _, w in denied))
            if rpm is not None:
                state.buckets["r"] = (r - 1, now)
            if tpm is not None:
                state.buckets["t"] = (t - ask.tokens, now)
            if ask.holds_lease:
                state.leases[ask.lease] = (now + ask.lease_ttl_s, ask.sequences)
            return Decision(True)

    async def renew(self, key: str, lease: str, ttl_s: float) -> bool:
        with self._lock:
            now = self._clock()
            state = self._keys.get(key)
            if state is None:
                return False
            state.purge(now)
            if lease not in state.leases:
                return False
            state.leases[lease] = (now + ttl_s, state.leases[lease][1])
            return True

    async def release(
        self, key: str, lease: str, *, token_correction: int = 0,
        tokens_per_minute: int | None = None,
    ) -> None:
        with self._lock:
            now = self._clock()
            state = self._keys.get(key)
            if state is None:
                return
            state.purge(now)
            state.leases.pop(lease, None)
            tpm = tokens_per_minute
            if tpm is not None and token_correction:
                level = min(float(tpm), state.level("t", tpm, now) - token_correction)
                state.buckets["t"] = (level, now)
            if not state.leases and all(
                level >= 0 and now - at >= 60.0 for level, at in state.buckets.values()
            ):
                del self._keys[key]  # idle and refilled: nothing worth keeping

    async def ping(self) -> None:
        return None

    async def aclose(self) -> None:
        with self._lock:
            self._keys.clear()
