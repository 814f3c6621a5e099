"""Append-only spill files of usage records the database did not take (yet).

Each server process owns one file, ``spill-<id>.jsonl`` (one JSON record per line), held
under an exclusive ``flock`` for the process's life; it is created under a temporary name,
locked, then renamed, so no one ever sees it unlocked. A file nobody holds belongs to a
process that died (or was restarted) before replaying it: any process may claim it
(:func:`orphans`), replay it and remove it. Several processes may share one folder (engines
on one machine): the lock keeps each file to one of them. Replays are safe to repeat: the
ledger skips records it already holds (unique request ids).
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import uuid
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

PATTERN = "spill-*.jsonl"


def _iso(value: Any) -> str:
    if isinstance(value, datetime):
        return value.isoformat()
    raise TypeError(f"cannot spill a {type(value).__name__}")


class SpillFile:
    """One locked, append-only file of records, read back in order from a remembered offset."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self._fd = fd
        self.offset = 0
        """Bytes already replayed into the database (the lines before it are written)."""

    @classmethod
    def create(cls, folder: Path) -> SpillFile:
        """A new file of this process in ``folder`` (locked before it gets its name)."""
        folder.mkdir(parents=True, exist_ok=True)
        name = uuid.uuid4().hex
        tmp = folder / f".creating-{name}"
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        path = folder / f"spill-{name}.jsonl"
        os.rename(tmp, path)
        return cls(path, fd)

    @property
    def size(self) -> int:
        return os.fstat(self._fd).st_size

    @property
    def pending(self) -> bool:
        """Records written here and not yet replayed."""
        return self.size > self.offset

    def append(self, records: list[dict[str, Any]]) -> None:
        """Add records at the end, on disk (fsync) before this returns."""
        data = "".join(json.dumps(r, separators=(",", ":"), default=_iso) + "\n" for r in records)
        os.write(self._fd, data.encode())
        os.fsync(self._fd)

    def read(self, batch: int) -> Iterator[tuple[list[dict[str, Any]], int]]:
        """``(records, end offset)`` batches from :attr:`offset` on, in order. A line that
        is not JSON (a write cut by a crash) is skipped with a warning."""
        with open(os.dup(self._fd), "rb", closefd=True) as f:
            f.seek(self.offset)
            records: list[dict[str, Any]] = []
            while line := f.readline():
                if not line.endswith(b"\n"):
                    break  # a line still being written (or cut): not yet
                try:
                    records.append(json.loads(line))
                except ValueError:
                    logger.warning("usage spill %s: skipped a damaged line", self.path.name)
                if len(records) >= batch:
                    yield records, f.tell()
                    records = []
            if records:
                yield records, f.tell()
            elif f.tell() != self.offset:
                yield [], f.tell()

    def clear(self) -> None:
        """Everything was replayed: empty the file (it stays this process's)."""
        os.ftruncate(self._fd, 0)
        self.offset = 0

    def remove(self) -> None:
        """Delete the file and release it (an orphan, once replayed)."""
        self.path.unlink(missing_ok=True)
        self.close()

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)  # releases the lock
            self._fd = -1


def orphans(folder: Path, own: Path | None) -> Iterator[SpillFile]:
    """The spill files in ``folder`` that no live process holds, each locked for the caller."""
    if not folder.is_dir():
        return
    for path in sorted(folder.glob(PATTERN)):
        if own is not None and path == own:
            continue
        try:
            fd = os.open(path, os.O_RDWR | os.O_APPEND)
        except FileNotFoundError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        if not path.exists():  # replayed and removed by another process meanwhile
            os.close(fd)
            continue
        yield SpillFile(path, fd)
