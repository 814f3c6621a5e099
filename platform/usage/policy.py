"""How usage records are written and kept: one dataclass, one ``Settings`` field (flag and
``LORAMUX_*`` variable) per field, the defaults written here only."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class UsagePolicy:
    """The usage writer's queue, batches, spill file and the records' retention."""

    usage_queue_size: int = field(default=10_000, metadata={"doc": (
        "Usage records held in memory for the writer; past it a record is dropped (and "
        "counted by loramux_usage_records_dropped_total).")})
    usage_batch_size: int = field(default=500, metadata={"doc": (
        "Most usage records written to the database in one transaction.")})
    usage_flush_interval: float = field(default=1.0, metadata={"doc": (
        "Seconds a usage record may wait in memory before its batch is written.")})
    usage_write_timeout: float = field(default=5.0, metadata={"doc": (
        "Seconds one batch write may take; past it (a stalled database) the batch is "
        "spilled to disk and written again later (never counted twice).")})
    usage_retry_interval: float = field(default=2.0, metadata={"doc": (
        "Seconds between attempts to write spilled usage records while the database is "
        "down.")})
    usage_spill_dir: Path | None = field(default=None, metadata={"doc": (
        "Where usage records wait while the database is down (append-only files, replayed "
        "in order when it returns, also after a restart); None = <data dir>/usage-spill.")})
    usage_spill_max_bytes: int = field(default=1024**3, metadata={"doc": (
        "Most bytes of spilled usage records kept on disk; past it new records are "
        "dropped (and counted).")})
    usage_retention_days: int | None = field(default=90, metadata={"doc": (
        "Days usage records are kept (older ones are deleted hourly); None keeps them "
        "all.")})

    def __post_init__(self) -> None:
        if min(self.usage_queue_size, self.usage_batch_size, self.usage_spill_max_bytes) < 1:
            raise ValueError("usage_queue_size, usage_batch_size and usage_spill_max_bytes "
                             "must be >= 1")
        if not (self.usage_flush_interval > 0 and self.usage_retry_interval > 0
                and self.usage_write_timeout > 0):
            raise ValueError("usage_flush_interval, usage_retry_interval and "
                             "usage_write_timeout must be positive numbers of seconds")
        if self.usage_retention_days is not None and self.usage_retention_days < 1:
            raise ValueError("usage_retention_days must be >= 1 or None (keep every record)")
