"""What the dashboard shows that no engine or registry counter holds: requests in flight
per adapter, requests and generated tokens in a rolling window (with a tokens/s series for
the sparklines), when each adapter was last used, and recent 429s per tenant.

In-process and bounded: one ``Activity`` per server, fed by the request path
(:meth:`Activity.begin` / :meth:`Activity.end` in ``openai/serving.py``) and by the
error handler (:meth:`Activity.rejected` for every 429, through ``app.record_rejection``).
Thread-safe; O(1) per call.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict, deque
from dataclasses import dataclass, field
from typing import Any

BUCKET_S = 2
"""Width of one sparkline bucket, in seconds."""
WINDOW_S = 60
"""The rolling window ("last minute")."""
MAX_REJECTIONS = 50
"""Recent 429s kept per tenant."""


@dataclass
class _Series:
    """Requests and tokens per ``BUCKET_S`` bucket over the last ``WINDOW_S``."""

    buckets: dict[int, list[int]] = field(default_factory=dict)  # bucket start -> [requests, tokens]

    def add(self, now: float, requests: int, tokens: int) -> None:
        b = int(now // BUCKET_S) * BUCKET_S
        slot = self.buckets.setdefault(b, [0, 0])
        slot[0] += requests
        slot[1] += tokens
        for old in [k for k in self.buckets if k <= now - WINDOW_S - BUCKET_S]:
            del self.buckets[old]

    def totals(self, now: float) -> tuple[int, int]:
        live = [v for k, v in self.buckets.items() if k > now - WINDOW_S]
        return sum(v[0] for v in live), sum(v[1] for v in live)

    def tokens_per_s(self, now: float) -> list[float]:
        """Oldest first, one point per bucket (the current, partial one last)."""
        last = int(now // BUCKET_S) * BUCKET_S
        starts = range(last - WINDOW_S + BUCKET_S, last + 1, BUCKET_S)
        return [self.buckets.get(s, (0, 0))[1] / BUCKET_S for s in starts]


_TENANT = "tenant:"


def _tenant_key(tenant_id: int | None) -> str:
    return f"{_TENANT}{tenant_id if tenant_id is not None else '-'}"


@dataclass(frozen=True)
class Rejection:
    """One 429 a tenant got."""

    at: float
    code: str | None
    message: str


class Activity:
    """The rolling request counters the dashboard reads."""

    def __init__(self, clock=time.time) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._open: dict[str, tuple[str, str]] = {}  # request id -> (label, tenant key)
        self._inflight: dict[str, int] = defaultdict(int)  # by label and by tenant key
        self._series: dict[str, _Series] = defaultdict(_Series)
        self._last_used: dict[str, float] = {}
        self._rejections: dict[int | None, deque[Rejection]] = defaultdict(
            lambda: deque(maxlen=MAX_REJECTIONS)
        )

    def begin(self, request_id: str, label: str, caller: Any = None) -> None:
        """A request for ``label`` (an engine key or ``base``) from ``caller`` (a
        ``Caller``, or None) enters the engine."""
        who = _tenant_key(getattr(caller, "tenant_id", None))
        with self._lock:
            self._open[request_id] = (label, who)
            for k in (label, who):
                self._inflight[k] += 1
            self._last_used[label] = self._clock()

    def end(self, request_id: str, generated_tokens: int) -> None:
        """The request left the engine (any outcome); idempotent."""
        now = self._clock()
        with self._lock:
            opened = self._open.pop(request_id, None)
            if opened is None:
                return
            for k in opened:
                self._inflight[k] -= 1
                if self._inflight[k] <= 0:
                    del self._inflight[k]
                self._series[k].add(now, 1, generated_tokens)
            self._last_used[opened[0]] = now

    def rejected(self, tenant_id: int | None, code: str | None, message: str) -> None:
        """A caller got a 429 (queue full, rate limit, quota)."""
        with self._lock:
            self._rejections[tenant_id].append(Rejection(self._clock(), code, message))

    # --- reads --------------------------------------------------------------------------
    def adapter(self, label: str) -> dict[str, Any]:
        """``in_flight``, ``requests_1m``, ``tokens_1m``, ``tokens_per_s`` (series) and
        ``last_used`` (epoch seconds or None) of one adapter label."""
        return self._read(label)

    def tenant(self, tenant_id: int | None) -> dict[str, Any]:
        """The same numbers for every request of one tenant (any model)."""
        return self._read(_tenant_key(tenant_id))

    def _read(self, label: str) -> dict[str, Any]:
        now = self._clock()
        with self._lock:
            series = self._series.get(label) or _Series()
            requests, tokens = series.totals(now)
            return {
                "in_flight": self._inflight.get(label, 0),
                "requests_1m": requests,
                "tokens_1m": tokens,
                "tokens_per_s": series.tokens_per_s(now),
                "last_used": self._last_used.get(label),
            }

    def tokens_per_s(self, seconds: int = 10) -> float:
        """Generated tokens per second over the last ``seconds``, every adapter together."""
        now = self._clock()
        with self._lock:
            total = sum(
                v[1] for name, s in self._series.items() if not name.startswith(_TENANT)
                for k, v in s.buckets.items() if k > now - seconds - BUCKET_S
            )
        return total / seconds

    def rejections(self, tenant_id: int | None, since_s: float = 3600) -> list[Rejection]:
        """The tenant's recent 429s, newest first."""
        now = self._clock()
        with self._lock:
            return [r for r in reversed(self._rejections.get(tenant_id, ())) if r.at > now - since_s]
