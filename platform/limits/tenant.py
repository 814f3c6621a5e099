"""``TenantLimiter``: a tenant's quotas applied to each request through a backend.

Used by the HTTP layer around everything a request does after it is parsed::

    cost = RequestCost.estimate(len(prompt_ids), params.max_tokens, params.n, params.best_of)
    async with limiter.hold(tenant.id, quotas, cost) as hold:   # RateLimited → 429
        ...generate...
        hold.charge(prompt_tokens + completion_tokens)          # settled at exit

On entry the backend checks and charges every limit in one atomic step and takes a
lease; while the block runs the lease is renewed every third of its TTL; on exit (success,
error or cancellation) the lease is released and the token bucket corrected by
actual − estimated tokens.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from loramux.platform.limits.backend import Ask, LimitBackend

if TYPE_CHECKING:
    from loramux.registry.quotas import Quotas

logger = logging.getLogger(__name__)

RATE_LIMITS = ("max_concurrent_requests", "max_queued_sequences", "requests_per_minute",
               "tokens_per_minute")  # fmt: skip


class LimitError(Exception):
    """A request is refused by a tenant quota; ``limit`` is the quota field name."""

    def __init__(self, limit: str, message: str) -> None:
        self.limit = limit
        super().__init__(message)


class RateLimited(LimitError):
    """Over a limit now; retry after ``retry_after`` seconds (HTTP 429 + ``Retry-After``,
    OpenAI code ``rate_limit_exceeded``). ``retry_after_header`` is the rounded-up value."""

    def __init__(self, limit: str, retry_after: float) -> None:
        self.retry_after = retry_after
        super().__init__(
            limit, f"rate limit reached for {limit}; retry after {retry_after:.1f} s"
        )

    @property
    def retry_after_header(self) -> str:
        return str(max(1, math.ceil(self.retry_after)))


class RequestTooLarge(LimitError):
    """The request alone needs more than a limit allows: retrying cannot help (HTTP 429
    without ``Retry-After``, or 400; ``requested`` and ``allowed`` say by how much)."""

    def __init__(self, limit: str, requested: int, allowed: int, what: str) -> None:
        self.requested, self.allowed = requested, allowed
        super().__init__(
            limit, f"this request needs {requested} {what} but the tenant's {limit} is "
            f"{allowed}; lower n or best_of",
        )


class LimiterUnavailable(Exception):
    """The limits backend (Redis) could not be asked; the caller answers 503."""


@dataclass(frozen=True)
class RequestCost:
    """What one request charges: ``tokens`` against ``tokens_per_minute`` (an estimate,
    corrected at exit), ``sequences`` against ``max_queued_sequences``."""

    tokens: int
    sequences: int = 1

    def __post_init__(self) -> None:
        if self.tokens < 0 or self.sequences < 1:
            raise ValueError(f"bad request cost {self!r}")

    @classmethod
    def estimate(
        cls, prompt_tokens: int, max_tokens: int, n: int = 1, best_of: int | None = None
    ) -> RequestCost:
        """Prompt + ``max_tokens`` for each of ``max(n, best_of)`` sequences."""
        sequences = max(n, best_of or n)
        return cls(prompt_tokens + max_tokens * sequences, sequences)

    def __add__(self, other: RequestCost) -> RequestCost:
        """Two requests' costs together (one HTTP request with several prompts)."""
        return RequestCost(self.tokens + other.tokens, self.sequences + other.sequences)


class QuotaHold:
    """A request's hold on its tenant's quotas, inside ``TenantLimiter.hold``."""

    def __init__(self, lease: str, cost: RequestCost) -> None:
        self.lease = lease
        self.cost = cost
        self.actual_tokens: int | None = None
        self.objectives: tuple[int | None, int | None] = (None, None)
        """The tenant's goodput objectives ``(ttft_ms, itl_ms)`` from its quotas (None: the
        engine's), handed to the engine's step budget for its requests."""

    def charge(self, tokens: int) -> None:
        """Record the tokens the request really used (prompt + generated, all sequences);
        the difference with ``cost.tokens`` is settled when the block exits. Without a
        call, the estimate stands."""
        self.actual_tokens = int(tokens)


class TenantLimiter:
    """Quotas × backend. One per process, shared by every request.

    ``lease_ttl_s``: how long a slot outlives a gateway that died holding it.
    ``busy_retry_after_s``: the ``Retry-After`` hint when a concurrency limit denies.
    """

    def __init__(
        self, backend: LimitBackend, *, lease_ttl_s: float = 30.0, busy_retry_after_s: float = 1.0
    ) -> None:
        if not lease_ttl_s > 0 or not busy_retry_after_s > 0:
            raise ValueError("lease_ttl_s and busy_retry_after_s must be > 0")
        self.backend = backend
        self.lease_ttl_s = lease_ttl_s
        self.busy_retry_after_s = busy_retry_after_s

    @contextlib.asynccontextmanager
    async def hold(
        self, tenant: int | str, quotas: Quotas, cost: RequestCost
    ) -> AsyncIterator[QuotaHold]:
        """Hold ``tenant``'s ``quotas`` for one request or raise :class:`RateLimited`
        / :class:`RequestTooLarge`, or :class:`LimiterUnavailable` when the backend fails."""
        hold = QuotaHold(uuid.uuid4().hex, cost)
        if all(getattr(quotas, name) is None for name in RATE_LIMITS):
            yield hold
            return
        seqs = quotas.max_queued_sequences
        if seqs is not None and cost.sequences > seqs:
            raise RequestTooLarge("max_queued_sequences", cost.sequences, seqs, "sequences")
        key = str(tenant)
        ask = Ask(
            lease=hold.lease,
            lease_ttl_s=self.lease_ttl_s,
            requests_per_minute=quotas.requests_per_minute,
            tokens_per_minute=quotas.tokens_per_minute,
            tokens=cost.tokens,
            max_concurrent_requests=quotas.max_concurrent_requests,
            max_queued_sequences=seqs,
            sequences=cost.sequences,
            busy_retry_after_s=self.busy_retry_after_s,
        )
        try:
            decision = await self.backend.acquire(key, ask)
        except Exception as e:
            logger.exception("rate-limit backend failed for tenant %s", key)
            raise LimiterUnavailable("the rate limiter is unavailable; retry shortly") from e
        if not decision.allowed:
            raise RateLimited(decision.limit or "rate limit", decision.retry_after)
        renewer = asyncio.create_task(self._renew(key, hold.lease)) if ask.holds_lease else None
        try:
            yield hold
        finally:
            if renewer is not None:
                renewer.cancel()
            correction = 0
            if hold.actual_tokens is not None:
                correction = hold.actual_tokens - cost.tokens
            release = self.backend.release(
                key, hold.lease, token_correction=correction,
                tokens_per_minute=quotas.tokens_per_minute,
            )  # fmt: skip
            try:
                await asyncio.shield(release)
            except asyncio.CancelledError:
                raise
            except Exception:  # the lease expires by itself; the request's outcome stands
                logger.exception("could not release rate-limit lease of tenant %s", key)

    async def _renew(self, key: str, lease: str) -> None:
        while True:
            await asyncio.sleep(self.lease_ttl_s / 3)
            try:
                if not await self.backend.renew(key, lease, self.lease_ttl_s):
                    logger.warning("rate-limit lease of tenant %s expired before renewal", key)
                    return
            except Exception:
                logger.exception("could not renew rate-limit lease of tenant %s", key)

    async def aclose(self) -> None:
        """Close the backend. Called at shutdown."""
        await self.backend.aclose()


def build_limiter(redis_url: str | None = None, *,
                  redis_timeouts: tuple[float, float] | None = None, **kwargs) -> TenantLimiter:
    """The limiter for ``--redis-url``: a :class:`RedisBackend` shared by every gateway
    when a URL is given (``redis_timeouts``: socket and connect timeouts), else the
    in-process backend. ``kwargs`` go to :class:`TenantLimiter`."""
    if redis_url:
        from loramux.platform.limits.redis_backend import RedisBackend

        return TenantLimiter(RedisBackend.from_url(redis_url, timeouts=redis_timeouts), **kwargs)
    from loramux.platform.limits.memory import InProcessBackend

    return TenantLimiter(InProcessBackend(), **kwargs)
