"""What a rate-limit backend does: one atomic quota check per request, a lease while
the request runs, and a release that settles the token estimate.

Per key (one tenant) a backend keeps two token buckets and a set of leases:

- ``requests_per_minute``: capacity = the quota, refilled at quota/60 per second, full
  when first seen; a request takes 1.
- ``tokens_per_minute``: same shape over tokens; a request needs ``min(tokens, capacity)``
  in the bucket and then takes all its ``tokens`` (the level may go negative: a request
  larger than the bucket waits for a full one and leaves a debt), so any request fits
  eventually and the average rate holds.
- leases: each admitted request holds one lease (``sequences`` counted against
  ``max_queued_sequences``; the count of leases against ``max_concurrent_requests``) that
  expires ``lease_ttl_s`` after it was taken or last renewed, so a gateway that crashes
  cannot leak slots.

An :class:`Ask` is admitted only if every limit passes; then, and only then, all of them
are charged. A ``None`` limit is not checked. Denials name the first limit that failed in
the order concurrency, sequences, requests, tokens; ``retry_after`` is the longest wait
among the failing ones (for the two counters it is the ``busy_retry_after_s`` hint).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class Ask:
    """One quota check for one key."""

    lease: str
    """A fresh unique id; used to renew and release."""
    lease_ttl_s: float
    requests_per_minute: int | None
    tokens_per_minute: int | None
    tokens: int
    """Estimated prompt + completion tokens (corrected at release)."""
    max_concurrent_requests: int | None
    max_queued_sequences: int | None
    sequences: int
    """Sequences this request runs (``max(n, best_of)``)."""
    busy_retry_after_s: float = 1.0
    """The ``retry_after`` hint when a concurrency or sequence limit denies."""

    @property
    def holds_lease(self) -> bool:
        """Whether the backend must track a lease (only when a counter limit is set)."""
        return self.max_concurrent_requests is not None or self.max_queued_sequences is not None


@dataclass(frozen=True)
class Decision:
    """The answer to an :class:`Ask`."""

    allowed: bool
    limit: str | None = None
    """The quota field that denied (``"requests_per_minute"``, …), ``None`` when allowed."""
    retry_after: float = 0.0
    """Seconds until the request could pass, when denied."""


class LimitBackend(Protocol):
    """Shared state of the limits. The in-process backend serves one process; the Redis
    backend is shared by every gateway replica. A backend is also a
    :class:`~loramux.platform.bulkheads.Pingable`: ``/ready`` asks it."""

    dependency: str | None
    """What ``/ready`` reports it as (``redis``); None = in the process, nothing to ask."""

    async def ping(self) -> None:
        """Raise unless the backend answers (``/ready``, the dashboard's overview)."""
        ...

    async def acquire(self, key: str, ask: Ask) -> Decision:
        """Check every limit and, if all pass, charge them and take the lease. Atomic."""
        ...

    async def renew(self, key: str, lease: str, ttl_s: float) -> bool:
        """Push a live lease's expiry to now + ``ttl_s``; ``False`` if it already expired.
        Called periodically while a request runs longer than a fraction of the TTL."""
        ...

    async def release(
        self, key: str, lease: str, *, token_correction: int = 0,
        tokens_per_minute: int | None = None,
    ) -> None:
        """Drop the lease and add ``token_correction`` (actual − estimated tokens; negative
        refunds) to the token bucket, never above its capacity. Called once per admitted
        request when it ends, however it ends."""
        ...

    async def aclose(self) -> None:
        """Release connections. Called at shutdown."""
        ...


def bucket_level(level: float, capacity: float, elapsed_s: float) -> float:
    """A bucket's level ``elapsed_s`` after it was ``level``: refilled at capacity/60 per
    second, never above capacity."""
    return min(capacity, level + max(0.0, elapsed_s) * capacity / 60.0)


def bucket_wait_s(level: float, need: float, capacity: float) -> float:
    """Seconds until a bucket at ``level`` holds ``need``."""
    return max(0.0, (need - level) * 60.0 / capacity)
