"""The one small time-to-live cache every platform lookup uses (API keys, tenants, quotas,
model resolutions).

An entry is *fresh* for ``ttl`` seconds after it was stored. :meth:`TTLCache.get_or_load`
and :meth:`TTLCache.aget_or_load` return a fresh entry or call the loader and store what it
returns. With ``stale_for > 0`` and ``stale_on`` naming exception types, a loader that raises
one of them (a dependency that is down: the registry's database, Redis) is answered with
the last good value for up to ``stale_for`` seconds past its expiry, so a short outage does
not turn every cached caller away; past that bound, or without a last good value, the
error propagates. Other exceptions always propagate.

The cache is bounded (``maxsize`` entries; expired entries are dropped first, then the
oldest) and safe to share between the event loop and worker threads. Loaders run outside
the lock. Concurrent misses of one key in one event loop share one load
(:meth:`TTLCache.aget_or_load`): a burst of requests with a cold key costs the database
one call, not one per request (which would fill its bulkhead). Blocking
:meth:`TTLCache.get_or_load` calls do not share; the later store wins.

    cache = TTLCache(ttl=5.0)
    quotas = await cache.aget_or_load(tenant_id, lambda: run_in_threadpool(get, tenant_id))
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")

logger = logging.getLogger(__name__)

_MISSING = object()


class TTLCache(Generic[K, V]):
    """A bounded mapping whose entries expire ``ttl`` seconds after they were stored.

    ``cache_none``: whether a loader's ``None`` is stored (a cached "no such thing") or
    looked up again next time. ``clock``: seconds, monotonic (tests pass a fake one)."""

    def __init__(
        self,
        ttl: float,
        *,
        maxsize: int = 10_000,
        cache_none: bool = True,
        stale_for: float = 0.0,
        stale_on: tuple[type[BaseException], ...] = (),
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not ttl >= 0:
            raise ValueError(f"ttl must be >= 0, got {ttl}")
        if maxsize < 1:
            raise ValueError(f"maxsize must be >= 1, got {maxsize}")
        if not stale_for >= 0:
            raise ValueError(f"stale_for must be >= 0, got {stale_for}")
        self.ttl = ttl
        self.maxsize = maxsize
        self.cache_none = cache_none
        self.stale_for = stale_for
        self.stale_on = tuple(stale_on)
        self._clock = clock
        self._entries: dict[K, tuple[float, V]] = {}  # key -> (stored at, value), oldest first
        self._loading: dict[K, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self._lock = threading.Lock()

    # --- plain mapping ---------------------------------------------------------------
    def get(self, key: K, default: V | None = None) -> V | None:
        """The fresh value under ``key``, else ``default``."""
        value = self._fresh(key)
        return default if value is _MISSING else value

    def __contains__(self, key: object) -> bool:
        return self._fresh(key) is not _MISSING

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def usable(self, key: K, default: V | None = None) -> V | None:
        """The value under ``key`` while it is fresh or within the stale window
        (``ttl + stale_for``), else ``default``; no loader runs."""
        with self._lock:
            hit = self._entries.get(key)
        if hit is not None and self._clock() - hit[0] < self.ttl + self.stale_for:
            return hit[1]
        return default

    def put(self, key: K, value: V) -> None:
        """Store ``value`` under ``key``, fresh from now."""
        now = self._clock()
        with self._lock:
            self._entries.pop(key, None)
            if len(self._entries) >= self.maxsize:
                self._make_room(now)
            self._entries[key] = (now, value)

    def pop(self, key: K) -> None:
        """Forget ``key`` (no error when absent)."""
        with self._lock:
            self._entries.pop(key, None)

    def discard_where(self, predicate: Callable[[K], bool]) -> None:
        """Forget every key for which ``predicate(key)`` is true."""
        with self._lock:
            for key in [k for k in self._entries if predicate(k)]:
                del self._entries[key]

    def clear(self) -> None:
        """Forget everything."""
        with self._lock:
            self._entries.clear()

    # --- read-through ----------------------------------------------------------------
    def get_or_load(self, key: K, loader: Callable[[], V]) -> V:
        """The fresh value under ``key``, else ``loader()`` (stored; see the module doc for
        what happens when it raises)."""
        value = self._fresh(key)
        if value is not _MISSING:
            return value
        try:
            value = loader()
        except self.stale_on as exc:
            return self._stale_or_raise(key, exc)
        self._store(key, value)
        return value

    async def aget_or_load(self, key: K, loader: Callable[[], Awaitable[V]]) -> V:
        """:meth:`get_or_load` with an async loader (e.g. ``run_in_threadpool(...)``);
        concurrent misses of ``key`` wait for the first one's load and share its outcome."""
        value = self._fresh(key)
        if value is not _MISSING:
            return value
        loop = asyncio.get_running_loop()
        with self._lock:
            pending = self._loading.get(key)
            shared = pending is not None and pending[0] is loop
            if not shared:
                fut: asyncio.Future = loop.create_future()
                fut.add_done_callback(_consume)
                self._loading[key] = (loop, fut)
        if shared:
            try:
                return await asyncio.shield(pending[1])
            except asyncio.CancelledError:
                if pending[1].cancelled():  # the loading caller went away: load ourselves
                    return await self.aget_or_load(key, loader)
                raise
        try:
            try:
                value = await loader()
            except self.stale_on as exc:
                value = self._stale_or_raise(key, exc)
            else:
                self._store(key, value)
        except asyncio.CancelledError:
            fut.cancel()
            raise
        except BaseException as exc:
            fut.set_exception(exc)
            raise
        else:
            fut.set_result(value)
            return value
        finally:
            with self._lock:
                if self._loading.get(key, (None, None))[1] is fut:
                    del self._loading[key]

    # --- internals -------------------------------------------------------------------
    def _fresh(self, key: object):
        with self._lock:
            hit = self._entries.get(key)
        if hit is not None and self._clock() - hit[0] < self.ttl:
            return hit[1]
        return _MISSING

    def _store(self, key: K, value: V) -> None:
        if value is not None or self.cache_none:
            self.put(key, value)

    def _stale_or_raise(self, key: K, exc: BaseException):
        with self._lock:
            hit = self._entries.get(key)
        if hit is not None and self._clock() - hit[0] < self.ttl + self.stale_for:
            logger.warning("serving a stale cached value for %r: %s", key, exc)
            return hit[1]
        raise exc

    def _make_room(self, now: float) -> None:
        """Drop expired entries past the stale window; if still full, the oldest (lock held)."""
        keep = self.ttl + self.stale_for
        for key in [k for k, (t, _) in self._entries.items() if now - t >= keep]:
            del self._entries[key]
        while len(self._entries) >= self.maxsize:
            del self._entries[next(iter(self._entries))]


def _consume(fut: asyncio.Future) -> None:
    """Mark a shared load's exception as seen (nobody else may wait for it)."""
    if not fut.cancelled():
        fut.exception()
