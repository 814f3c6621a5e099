"""The usage writer: finished requests' records go to SQL in batches, off the request path.

The request path calls :meth:`UsageRecorder.record` (never blocks: a bounded queue; a
record that finds it full is dropped and counted). One writer thread takes up to
``usage_batch_size`` records at a time (waiting at most ``usage_flush_interval`` s) and
appends them to the ledger in one transaction. When the database fails, the batch goes to
this process's spill file (:mod:`.spill`) instead, and so does every later batch while
anything is spilled, so records reach the database in the order they finished; every
``usage_retry_interval`` s the writer replays the file from where it stopped, and once all
of it is in, writes go straight to the database again. Spill files other processes left
(a crash, a restart during an outage) are claimed and replayed the same way. A replay
repeated after a partial success counts nothing twice (the ledger skips known request
ids). Nothing is lost in an outage while the spill stays under ``usage_spill_max_bytes``.

Every write runs in the writer's own small bulkhead with a deadline
(``usage_write_timeout``): a stalled database (one that accepts and never answers) costs a
batch that long, then it is spilled like any failure; the stuck write may still land
later, which the replay's duplicate check absorbs.

Records that the database refuses for themselves (not an outage: a value out of range)
are dropped one by one so they cannot block the others, and counted.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

from loramux.platform.bulkheads import Bulkhead, dependency_kind
from loramux.platform.usage.policy import UsagePolicy
from loramux.platform.usage.spill import SpillFile, orphans

logger = logging.getLogger(__name__)

PRUNE_EVERY_S = 3600.0
PRUNE_TIMEOUT_S = 120.0
ORPHAN_SCAN_EVERY_S = 30.0


def refused(exc: BaseException) -> bool:
    """Whether the database refused the records themselves (a value it cannot store), not
    failed to take them: only then may one be dropped. Anything else is retried."""
    from sqlalchemy import exc as sa

    if dependency_kind(exc) is not None:
        return False
    return isinstance(exc, (sa.DataError, sa.IntegrityError, ValueError, TypeError))


class UsageCounters:
    """What the writer reports (the server's Prometheus series, or nothing in tests)."""

    def written(self, n: int) -> None: ...
    def spilled(self, n: int) -> None: ...
    def dropped(self, reason: str, n: int) -> None: ...
    def pending(self, queued: int, spilled: int) -> None: ...


class UsageRecorder:
    """Batches usage records into ``write`` (the ledger's append) on a thread of its own.

    ``write(records)`` raises when the database fails; ``prune(before)`` deletes records
    past the retention (hourly). Start with :meth:`start`; :meth:`close` writes (or
    spills) what is left."""

    def __init__(self, write: Callable[[list[dict[str, Any]]], object], spill_dir: Path,
                 policy: UsagePolicy | None = None, *,
                 prune: Callable[[datetime], object] | None = None,
                 counters: UsageCounters | None = None) -> None:
        self.policy = p = policy or UsagePolicy()
        self.write = write
        self.prune = prune
        self.spill_dir = Path(spill_dir)
        self.counters = counters or UsageCounters()
        self._queue: queue.Queue = queue.Queue(maxsize=p.usage_queue_size)
        # deadline and bounded threads only: the writer paces its own retries
        # (usage_retry_interval), so the breaker never opens
        self._db = Bulkhead("database", workers=2, timeout=p.usage_write_timeout, retry_after=1,
                            failures=2**31, reset_after=p.usage_retry_interval)
        self._spill: SpillFile | None = None
        self._spilled = 0  # records in our own file not yet replayed
        self._retry_at = 0.0
        self._orphans_at = 0.0
        self._pruned_at = 0.0
        self._failing = False
        self._orphans_pending = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # --- the request path -------------------------------------------------------------
    def record(self, record: dict[str, Any]) -> bool:
        """Queue one record (called when a request finishes); False when it was dropped
        because the queue is full."""
        try:
            self._queue.put_nowait(record)
        except queue.Full:
            self.counters.dropped("queue_full", 1)
            return False
        return True

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait until every record queued before this call is in the database (or, while
        it is down, in the spill file), replaying spilled ones first if the database
        answers; False on timeout. Called before usage is read back."""
        if self._thread is None or not self._thread.is_alive():
            return False
        done = threading.Event()
        try:
            self._queue.put(done, timeout=timeout)
        except queue.Full:
            return False
        return done.wait(timeout)

    # --- the writer thread -----------------------------------------------------------
    def start(self) -> UsageRecorder:
        self._thread = threading.Thread(target=self._run, name="usage-writer", daemon=True)
        self._thread.start()
        return self

    def close(self, timeout: float = 10.0) -> None:
        """Stop the writer after it wrote (or spilled) everything queued."""
        if self._thread is None:
            return
        self._stop.set()
        try:
            self._queue.put_nowait(None)  # wake it
        except queue.Full:
            pass
        self._thread.join(timeout)
        self._db.shutdown()
        if self._spill is not None and not self._spill.pending:
            self._spill.remove()
        elif self._spill is not None:
            self._spill.close()  # left for the next start to replay

    def _take(self) -> tuple[list[dict[str, Any]], list[threading.Event]]:
        records: list[dict[str, Any]] = []
        markers: list[threading.Event] = []
        deadline = time.monotonic() + self.policy.usage_flush_interval
        while len(records) < self.policy.usage_batch_size:
            # stopping: take what is queued, wait for nothing more (close() waits on us)
            left = 0.0 if self._stop.is_set() else deadline - time.monotonic()
            try:
                item = self._queue.get(timeout=left) if left > 0 else self._queue.get_nowait()
            except queue.Empty:
                break
            if item is None:  # close()'s wake-up
                continue
            if isinstance(item, threading.Event):
                markers.append(item)
                break  # what came before the marker is written first
            records.append(item)
        return records, markers

    def _run(self) -> None:
        self._orphans_at = time.monotonic() + ORPHAN_SCAN_EVERY_S
        self._replay_orphans()  # what an earlier process left goes in first
        while True:
            stopping = self._stop.is_set()
            records, markers = self._take()
            now = time.monotonic()
            due = markers or stopping or now >= self._retry_at
            if (self._orphans_pending and due) or now >= self._orphans_at:
                self._orphans_at = now + ORPHAN_SCAN_EVERY_S
                self._replay_orphans()
            if self._spilled and due and not self._orphans_pending:
                self._replay_own()
            if records:
                self._write(records)
            if self.prune is not None and now >= self._pruned_at and not self._failing:
                self._pruned_at = now + PRUNE_EVERY_S
                self._prune()
            self.counters.pending(self._queue.qsize(), self._spilled)
            for m in markers:
                m.set()
            if stopping and self._queue.empty():
                return

    def _write(self, records: list[dict[str, Any]]) -> None:
        if self._spilled or self._orphans_pending:  # keep the order: behind what waits
            self._to_spill(records)
            return
        try:
            self._insert(records)
        except Exception as e:
            self._failed(e)
            self._to_spill(records)

    def _insert(self, records: list[dict[str, Any]]) -> None:
        """Write one batch; a refusal that is not an outage is retried record by record
        and the records refused alone are dropped."""
        try:
            self._db.call_sync(self.write, records)
        except Exception as e:
            if not refused(e):
                raise  # an outage (or anything unclear): the caller spills, nothing is lost
            if len(records) == 1:
                logger.error("usage record dropped (refused by the database): %s", e)
                self.counters.dropped("refused", 1)
                return
            for r in records:
                self._insert([r])
            return
        if self._failing:
            logger.info("usage records: the database takes them again")
            self._failing = False
        self.counters.written(len(records))

    def _failed(self, exc: Exception) -> None:
        if not self._failing:
            logger.warning("usage records: the database failed (%s: %s); spilling to %s",
                           type(exc).__name__, exc, self.spill_dir)
        self._failing = True
        self._retry_at = time.monotonic() + self.policy.usage_retry_interval

    def _to_spill(self, records: list[dict[str, Any]]) -> None:
        try:
            if self._spill is None:
                self._spill = SpillFile.create(self.spill_dir)
            if self._spill.size >= self.policy.usage_spill_max_bytes:
                self.counters.dropped("spill_full", len(records))
                return
            self._spill.append(records)
        except OSError as e:
            logger.error("usage records dropped: cannot spill to %s: %s", self.spill_dir, e)
            self.counters.dropped("spill_failed", len(records))
            return
        self._spilled += len(records)
        self.counters.spilled(len(records))

    def _replay(self, spill: SpillFile) -> bool:
        """Write a spill file's records from its offset on; True when all are in."""
        try:
            for batch, end in spill.read(self.policy.usage_batch_size):
                if batch:
                    self._insert(batch)
                spill.offset = end
                if spill is self._spill:
                    self._spilled = max(0, self._spilled - len(batch))
        except Exception as e:
            self._failed(e)
            return False
        return True

    def _replay_own(self) -> None:
        if self._spill is not None and self._replay(self._spill):
            self._spill.clear()
            self._spilled = 0
            logger.info("usage records: every spilled record is in the database")

    def _replay_orphans(self) -> None:
        """Replay the files no live process holds; ``_orphans_pending`` while one could not
        be (new records then wait in the spill behind it)."""
        own = self._spill.path if self._spill is not None else None
        self._orphans_pending = False
        for orphan in orphans(self.spill_dir, own):
            if self._replay(orphan):
                logger.info("usage records: replayed %s left by an earlier process",
                            orphan.path.name)
                orphan.remove()
            else:
                orphan.close()
                self._orphans_pending = True
                return

    def _prune(self) -> None:
        days = self.policy.usage_retention_days
        if days is None:
            return
        try:
            self._db.call_sync(self.prune, datetime.now(timezone.utc) - timedelta(days=days),
                               timeout=PRUNE_TIMEOUT_S)
        except Exception as e:  # next hour again
            logger.warning("usage records: pruning past %d days failed: %s", days, e)
