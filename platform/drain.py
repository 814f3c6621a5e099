"""Graceful shutdown: SIGTERM drains the server within ``--shutdown-timeout``.

On SIGTERM :class:`DrainingServer` does not stop listening at once (uvicorn's default,
which refuses new connections while requests are still running): it marks the
:class:`Drain` as draining, so ``/ready`` answers 503 (the load balancer stops sending)
and every new request gets 503 + ``Retry-After`` with ``Connection: close`` (the client
retries on another replica), while the requests in flight finish. Once none is left,
or ``shutdown_timeout`` seconds have passed, the server stops; at the timeout the
``on_timeout`` hooks run first (the app fails the engine's open requests, so a stream
still running ends with an error event and ``[DONE]`` instead of a cut connection).
A second SIGTERM or SIGINT stops at once.
"""

from __future__ import annotations

import logging
import signal
import time
from collections.abc import Callable
from types import FrameType

import uvicorn

logger = logging.getLogger(__name__)

AFTER_TIMEOUT_S = 3.0
"""Seconds the failed requests get to send their error events before the server stops."""


class Drain:
    """The requests in flight and whether the server is draining (shared by the request
    middleware, ``/ready`` and :class:`DrainingServer`)."""

    def __init__(self) -> None:
        self.active = 0
        """HTTP requests being answered (a stream counts until its last byte)."""
        self.draining = False
        self.on_timeout: list[Callable[[], None]] = []
        """Called once when the drain times out with requests still in flight."""

    def timed_out(self) -> None:
        for hook in self.on_timeout:
            try:
                hook()
            except Exception:
                logger.exception("shutdown hook failed")


class DrainingServer(uvicorn.Server):
    """uvicorn's server, draining on the first SIGTERM (see the module doc)."""

    def __init__(self, config: uvicorn.Config, *, drain: Drain | None,
                 shutdown_timeout: float) -> None:
        super().__init__(config)
        self.drain = drain
        self.shutdown_timeout = shutdown_timeout
        self._deadline: float | None = None
        self._stop_at: float | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.drain is None or self._deadline is not None or sig != signal.SIGTERM:
            super().handle_exit(sig, frame)  # no drain, a second signal, or Ctrl-C
            return
        self._captured_signals.append(sig)
        self.begin_drain()

    def begin_drain(self) -> None:
        """Start draining (what SIGTERM does)."""
        assert self.drain is not None
        self.drain.draining = True
        self._deadline = time.monotonic() + self.shutdown_timeout
        logger.info("draining: %d requests in flight, at most %.0f s", self.drain.active,
                    self.shutdown_timeout)

    async def on_tick(self, counter: int) -> bool:
        if self._deadline is not None and not self.should_exit:
            now = time.monotonic()
            if self.drain.active == 0 or (self._stop_at is not None and now >= self._stop_at):
                logger.info("drained; stopping")
                self.should_exit = True
            elif self._stop_at is None and now >= self._deadline:
                logger.warning("shutdown timeout: ending %d requests with an error",
                               self.drain.active)
                self.drain.timed_out()
                self._stop_at = now + AFTER_TIMEOUT_S
        return await super().on_tick(counter)
