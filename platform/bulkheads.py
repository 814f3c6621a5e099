"""Dependencies are slow before they are down: bulkheads, deadlines and breakers.

Every blocking call to the database or the object store runs through a
:class:`Bulkhead`: its own bounded thread pool (so a stalled S3 holds only the store's
threads, never the ones base-model requests need), a deadline per call, and a breaker
that, after ``breaker_failures`` failures in a row, answers at once for
``breaker_reset`` seconds instead of queueing more callers behind a dead dependency.
A call that cannot run (pool full, breaker open) or does not finish in time raises
:class:`DependencyUnavailable`, which the error table turns into 503 + ``Retry-After``
naming the dependency kind only. The thread of a call past its deadline keeps running
until the dependency answers (or its own socket timeout fires); it still counts against
the pool, which is what keeps a stall contained.

:class:`Dependencies` holds one bulkhead per dependency and their health; ``/ready``
asks each dependency through :mod:`.probes`. The sizes and deadlines are
:class:`DependencyPolicy` fields (``Settings`` generates a flag for each).
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any, TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")
_MISSING = object()

@dataclass(frozen=True)
class DependencyPolicy:
    """Bulkhead sizes, per-call deadlines, breakers and Redis socket timeouts."""

    db_workers: int = field(default=8, metadata={"doc": (
        "Threads of the database bulkhead (calls past it wait in a queue of the same size).")})
    db_call_timeout: float = field(default=6.0, metadata={"doc": (
        "Seconds a request waits for one database call (the pool wait and the statement "
        "included) before it gets 503.")})
    store_workers: int = field(default=4, metadata={"doc": (
        "Threads of the object-store bulkhead (adapter fetches, uploads' writes).")})
    store_call_timeout: float = field(default=30.0, metadata={"doc": (
        "Seconds a request waits for an adapter fetch from the object store.")})
    redis_socket_timeout: float = field(default=1.0, metadata={"doc": (
        "Seconds a Redis command may take (rate limits, cluster state).")})
    redis_connect_timeout: float = field(default=1.0, metadata={"doc": (
        "Seconds to open a Redis connection.")})
    breaker_failures: int = field(default=3, metadata={"doc": (
        "Failures in a row after which a dependency's calls fail at once (503).")})
    breaker_reset: float = field(default=5.0, metadata={"doc": (
        "Seconds an open breaker fails calls at once before it lets one through again.")})
    dependency_retry_after: int = field(default=5, metadata={"doc": (
        "The Retry-After (seconds) of a 503 caused by a failed dependency.")})
    stale_hedge: float = field(default=0.2, metadata={"doc": (
        "Seconds a request waits for the refresh of an expired cached key, quota or model "
        "resolution before it is answered with the last good value (the refresh goes on).")})
    outage_staleness: float = field(default=300.0, metadata={"doc": (
        "Seconds past their TTL that cached API keys, quotas and adapter resolutions keep "
        "serving while the database is down (each use logged); 0 = fail at once.")})

    def __post_init__(self) -> None:
        if min(self.db_workers, self.store_workers, self.breaker_failures) < 1:
            raise ValueError("db_workers, store_workers and breaker_failures must be >= 1")
        if min(self.db_call_timeout, self.store_call_timeout, self.redis_socket_timeout,
               self.redis_connect_timeout, self.breaker_reset) <= 0:
            raise ValueError("dependency timeouts must be positive numbers of seconds")
        if self.outage_staleness < 0 or self.stale_hedge < 0:
            raise ValueError("outage_staleness and stale_hedge must be >= 0")


class DependencyUnavailable(Exception):
    """A dependency did not answer in time, its bulkhead is full or its breaker is open.

    ``kind`` is what clients may hear ("database", "object store", "rate limiter");
    ``retry_after`` the seconds they should wait."""

    def __init__(self, kind: str, reason: str, retry_after: int) -> None:
        super().__init__(f"the {kind} is unavailable ({reason})")
        self.kind = kind
        self.reason = reason
        self.retry_after = retry_after


@functools.cache
def dependency_errors() -> tuple[type[BaseException], ...]:
    """The exception classes that mean "a dependency failed" (what caches may answer
    with a stale value, what breakers count): :func:`dependency_kind` is not None."""
    import redis
    from sqlalchemy import exc as sa

    from loramux.registry.errors import ObjectStoreError

    return (DependencyUnavailable, sa.OperationalError, sa.InterfaceError, sa.TimeoutError,
            sa.DisconnectionError, redis.RedisError, ObjectStoreError)


def dependency_kind(exc: BaseException) -> str | None:
    """The dependency an exception says failed ("database", "object store", "redis"), or
    None for any other exception (a missing row, a bad adapter, a bug)."""
    if isinstance(exc, DependencyUnavailable):
        return exc.kind
    from loramux.registry.errors import ObjectIntegrityError, ObjectNotFound, ObjectStoreError

    if isinstance(exc, ObjectStoreError) and not isinstance(exc, ObjectNotFound | ObjectIntegrityError):
        return "object store"
    try:
        from sqlalchemy import exc as sa
    except ImportError:  # pragma: no cover - sqlalchemy is a dependency
        sa = None
    if sa is not None and isinstance(exc, sa.OperationalError | sa.InterfaceError
                                     | sa.TimeoutError | sa.DisconnectionError):
        return "database"
    try:
        import redis
    except ImportError:  # pragma: no cover - redis is a dependency
        return None
    if isinstance(exc, redis.RedisError):
        return "redis"
    return None


class Bulkhead:
    """One dependency's own bounded pool, per-call deadline and breaker.

    At most ``workers`` calls run and ``workers`` more wait; past that a call fails at
    once. Thread-safe; the async :meth:`call` is what request handlers use."""

    def __init__(self, kind: str, *, workers: int, timeout: float, retry_after: int,
                 failures: int = 3, reset_after: float = 5.0) -> None:
        self.kind = kind
        self.workers = workers
        self.timeout = timeout
        self.retry_after = retry_after
        self.failures = failures
        self.reset_after = reset_after
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix=f"lmx-{kind.replace(' ', '-')}")
        self._lock = threading.Lock()
        self._in_flight = 0
        self._failed = 0
        self._open_until = 0.0
        self.last_error: str | None = None
        """What the last failure was (server side only: may name hosts)."""

    # --- state -------------------------------------------------------------------------
    @property
    def in_flight(self) -> int:
        """Calls running or queued (a call past its deadline counts until its thread ends)."""
        return self._in_flight

    @property
    def is_open(self) -> bool:
        """True while the breaker fails calls at once."""
        return time.monotonic() < self._open_until

    def status(self) -> str:
        """``ok``, ``degraded`` (recent failures or a busy pool) or ``down`` (breaker open)."""
        if self.is_open:
            return "down"
        if self._failed or self._in_flight >= self.workers:
            return "degraded"
        return "ok"

    def _unavailable(self, reason: str) -> DependencyUnavailable:
        return DependencyUnavailable(self.kind, reason, self.retry_after)

    def record_success(self) -> None:
        with self._lock:
            self._failed = 0
            self._open_until = 0.0

    def record_failure(self, what: str) -> None:
        """Count a failure (a timeout, a dependency error); opens the breaker at the limit."""
        with self._lock:
            self._failed += 1
            self.last_error = what
            if self._failed >= self.failures and not self.is_open:
                self._open_until = time.monotonic() + self.reset_after
                logger.error("%s breaker open for %.1f s after %d failures (last: %s)",
                             self.kind, self.reset_after, self._failed, what)

    def _admit(self) -> None:
        with self._lock:
            if time.monotonic() < self._open_until:
                raise self._unavailable("breaker open")
            if self._in_flight >= 2 * self.workers:
                raise self._unavailable("too many calls waiting")
            self._in_flight += 1

    def _release(self, _future: Any = None) -> None:
        with self._lock:
            self._in_flight -= 1

    def _observe(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        try:
            result = fn(*args, **kwargs)
        except BaseException as exc:
            if dependency_kind(exc) is not None:
                self.record_failure(f"{type(exc).__name__}: {exc}")
            raise
        self.record_success()
        return result

    # --- calls -------------------------------------------------------------------------
    async def call(self, fn: Callable[..., T], *args: Any, timeout: float | None = None,
                   **kwargs: Any) -> T:
        """``fn(*args, **kwargs)`` in this bulkhead's pool, waited for at most ``timeout``
        seconds (default: the bulkhead's); raises :class:`DependencyUnavailable` when it
        cannot run or does not finish in time, else what ``fn`` raises."""
        self._admit()
        loop = asyncio.get_running_loop()
        ctx = contextvars.copy_context()
        try:
            future = loop.run_in_executor(
                self._pool, functools.partial(ctx.run, self._observe, fn, *args, **kwargs))
        except BaseException:
            self._release()
            raise
        future.add_done_callback(self._release)
        budget = self.timeout if timeout is None else timeout
        try:
            return await asyncio.wait_for(asyncio.shield(future), budget)
        except asyncio.TimeoutError:
            self.record_failure(f"no answer within {budget:g} s")
            logger.error("%s call %s did not answer within %g s",
                         self.kind, getattr(fn, "__qualname__", fn), budget)
            raise self._unavailable(f"no answer within {budget:g} s") from None

    def call_sync(self, fn: Callable[..., T], *args: Any, timeout: float | None = None,
                  **kwargs: Any) -> T:
        """The blocking twin of :meth:`call`, for threads (the engine's adapter source)."""
        self._admit()
        try:
            future = self._pool.submit(self._observe, fn, *args, **kwargs)
        except BaseException:
            self._release()
            raise
        future.add_done_callback(self._release)
        budget = self.timeout if timeout is None else timeout
        try:
            return future.result(budget)
        except FutureTimeout:
            if future.done():
                raise
            self.record_failure(f"no answer within {budget:g} s")
            raise self._unavailable(f"no answer within {budget:g} s") from None

    def shutdown(self) -> None:
        """Stop taking calls; threads stuck on a dependency are not waited for."""
        self._pool.shutdown(wait=False, cancel_futures=True)


class Dependencies:
    """The bulkheads of one server: ``db`` and ``store`` (and the health of Redis, whose
    async client has its own socket timeouts)."""

    def __init__(self, policy: DependencyPolicy | None = None) -> None:
        p = self.policy = policy or DependencyPolicy()
        common = dict(retry_after=p.dependency_retry_after, failures=p.breaker_failures,
                      reset_after=p.breaker_reset)
        self.db = Bulkhead("database", workers=p.db_workers, timeout=p.db_call_timeout, **common)
        self.store = Bulkhead("object store", workers=p.store_workers,
                              timeout=p.store_call_timeout, **common)
        self._refreshing: dict[tuple[int, Any], asyncio.Future] = {}

    def stale_cache(self, ttl: float, **kwargs: Any):
        """A :class:`~loramux.platform.ttl_cache.TTLCache` that answers from its last good
        value for ``outage_staleness`` seconds while a dependency is down."""
        from loramux.platform.ttl_cache import TTLCache

        return TTLCache(ttl, stale_for=self.policy.outage_staleness,
                        stale_on=dependency_errors(), **kwargs)

    async def read_through(self, cache: Any, key: Any, loader: Callable[[], Any]) -> Any:
        """``cache.aget_or_load(key, loader)`` (loader: a database call) that never holds
        the hot path on a slow or failing database once a value was seen: an expired
        entry still within the stale window is refreshed in the background, and the
        request waits for that refresh at most ``stale_hedge`` seconds (not at all while
        the database bulkhead is failing) before it is answered with the last good value
        (logged). One refresh per key runs at a time."""
        fresh = cache.get(key, _MISSING)
        if fresh is not _MISSING:
            return fresh
        stale = cache.usable(key, _MISSING)
        if stale is _MISSING:
            return await cache.aget_or_load(key, loader)
        task = self._refresh(cache, key, loader)
        if self.db.status() == "ok":
            done, _ = await asyncio.wait({task}, timeout=self.policy.stale_hedge)
            if task in done:
                exc = task.exception()
                if exc is None:
                    return task.result()
                if not isinstance(exc, dependency_errors()):
                    raise exc
        logger.warning("serving a stale cached value for %r: the database is slow or down", key)
        return stale

    def _refresh(self, cache: Any, key: Any, loader: Callable[[], Any]) -> asyncio.Future:
        marker = (id(cache), key)
        running = self._refreshing.get(marker)
        if running is not None:
            return running

        async def refresh() -> Any:
            value = await loader()
            if value is None and not cache.cache_none:
                cache.pop(key)
            else:
                cache.put(key, value)
            return value

        task = asyncio.ensure_future(refresh())
        self._refreshing[marker] = task

        def done(t: asyncio.Future) -> None:
            self._refreshing.pop(marker, None)
            if not t.cancelled() and t.exception() is not None:  # retrieved: no warning
                logger.debug("background refresh of %r failed: %s", key, t.exception())

        task.add_done_callback(done)
        return task

    def health(self) -> dict[str, str]:
        """``ok`` / ``degraded`` / ``down`` per bulkhead (what ``/ready`` reports)."""
        return {"database": self.db.status(), "object store": self.store.status()}

    def shutdown(self) -> None:
        self.db.shutdown()
        self.store.shutdown()
