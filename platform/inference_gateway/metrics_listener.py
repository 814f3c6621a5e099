"""The server's side of ``--protocol-metrics-port``: starts the listener process
(``metrics_process.py``) and feeds it.

A feed thread reads the engine's latest :class:`~loramux.engine.outputs.LoadReport`
every ``interval`` seconds (``AsyncEngine.load_report()``: never waits for the engine
thread), turns it into names-only :class:`~.exposition.ProtocolFacts` (``facts.py``) and
writes them to the process's stdin when they changed. A scrape never touches this
process: the listener answers from the last facts it got.

The listener process is restarted (at most once a second) when it dies.
"""

from __future__ import annotations

import contextlib
import logging
import select
import subprocess
import sys
import threading
import time
from collections.abc import Callable

from loramux.engine.outputs import LoadReport
from loramux.platform.inference_gateway.exposition import ProtocolFacts

logger = logging.getLogger(__name__)

MODULE = "loramux.platform.inference_gateway.metrics_process"
START_TIMEOUT_S = 20.0


class ListenerStartError(RuntimeError):
    """The protocol-metrics listener process could not listen (port taken, bad host)."""


class ProtocolMetricsListener:
    """Owns the listener process and the feed thread; :meth:`close` stops both."""

    def __init__(self, host: str, port: int, read_report: Callable[[], LoadReport | None],
                 to_facts: Callable[[LoadReport], ProtocolFacts], *,
                 interval: float = 0.01) -> None:
        """``read_report``: the engine's latest report (``AsyncEngine.load_report``);
        ``to_facts``: report -> facts (``facts.protocol_facts`` with the server's fixed
        fields). Starts the process (raises :class:`ListenerStartError`) and the feed."""
        self.host, self.port = host, port
        self.read_report, self.to_facts = read_report, to_facts
        self.interval = interval
        self.updates = 0
        """Facts written to the process (tests and the bench read it)."""
        self._stop = threading.Event()
        self._last_report: LoadReport | None = None
        self._last_line: bytes | None = None
        self._started_at = 0.0
        self._proc = self._spawn()
        self._thread = threading.Thread(target=self._run, name="protocol-metrics-feed",
                                        daemon=True)
        self._thread.start()

    # --- the process -----------------------------------------------------------------
    def _spawn(self) -> subprocess.Popen:
        self._started_at = time.monotonic()
        proc = subprocess.Popen(
            [sys.executable, "-m", MODULE, "--host", self.host, "--port", str(self.port)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        )
        ready, _, _ = select.select([proc.stdout], [], [], START_TIMEOUT_S)
        line = proc.stdout.readline().decode(errors="replace").strip() if ready else ""
        if line != "ready":
            with contextlib.suppress(Exception):
                proc.kill()
                proc.wait(timeout=5)
            raise ListenerStartError(
                f"the protocol metrics listener did not start on {self.host}:{self.port}: "
                + (line.removeprefix("error: ") or f"no answer in {START_TIMEOUT_S:.0f} s"))
        self._last_line = None  # a new process has no facts yet
        logger.info("protocol metrics on http://%s:%d/metrics (pid %d)", self.host, self.port,
                    proc.pid)
        return proc

    @property
    def pid(self) -> int:
        return self._proc.pid

    # --- the feed --------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.push()
            except Exception:
                logger.exception("protocol metrics feed failed")

    def push(self) -> bool:
        """Send the latest facts if they changed; True when something was written."""
        if self._proc.poll() is not None:
            if time.monotonic() - self._started_at < 1.0:
                return False
            logger.warning("the protocol metrics listener exited (%s); restarting it",
                           self._proc.returncode)
            self._proc = self._spawn()
        report = self.read_report()
        if report is None or report is self._last_report:
            return False
        self._last_report = report
        line = self.to_facts(report).to_json()
        if line == self._last_line:
            return False
        try:
            self._proc.stdin.write(line + b"\n")
            self._proc.stdin.flush()
        except (BrokenPipeError, OSError, ValueError):
            return False  # it died; restarted on the next turn
        self._last_line = line
        self.updates += 1
        return True

    def close(self) -> None:
        """Stop feeding and end the process (its stdin closes: it exits)."""
        self._stop.set()
        self._thread.join(timeout=5)
        with contextlib.suppress(Exception):
            self._proc.stdin.close()
        try:
            self._proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait(timeout=5)
        with contextlib.suppress(Exception):
            self._proc.stdout.close()
