"""The usage ledger: finished requests' records in SQL (``usage_records``), how they are
appended (idempotent batches: a batch written twice, as a replay after a database outage
may be, counts once), summed per tenant / adapter / version / day / key, turned into
per-version numbers (requests, tokens, errors, TTFT and TPOT percentiles over a window),
and pruned past their retention.

Who appends (in batches, off the request path, spilling to disk while the database is
down) is :mod:`loramux.platform.usage`; this module only speaks SQL.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from sqlalchemy import case, delete, func, insert, select

from loramux.registry.db import Database
from loramux.registry.models import UsageRecord

GROUP_KEYS = ("tenant", "adapter", "version", "day", "key")
"""What usage may be grouped by (``version`` implies ``adapter``)."""
_COLUMN_OF = {"tenant": "tenant_id", "adapter": "adapter", "version": "version", "day": "day",
              "key": "key_prefix"}
RECORD_FIELDS = tuple(c.name for c in UsageRecord.__table__.columns if c.name != "id")
PERCENTILES = (50, 90, 99)
MAX_SAMPLE = 20_000
"""Most recent latencies per (adapter, version) the percentiles are computed over."""


def percentile(sorted_values: Sequence[float], p: float) -> float | None:
    """Nearest-rank percentile of already sorted values (None for none)."""
    if not sorted_values:
        return None
    rank = max(1, math.ceil(p / 100 * len(sorted_values)))
    return sorted_values[rank - 1]


@dataclass
class VersionStats:
    """One version's numbers over a window."""

    requests: int = 0
    errors: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    ttft_ms: dict[str, float | None] = field(default_factory=dict)
    """``{"p50": ms, "p90": ms, "p99": ms}`` (None without a first token)."""
    tpot_ms: dict[str, float | None] = field(default_factory=dict)


class UsageLedger:
    """The ``usage_records`` table of one database. Thread-safe (a session per call)."""

    def __init__(self, db: Database) -> None:
        self.db = db

    def append(self, records: Iterable[dict[str, Any]]) -> int:
        """Insert records (dicts of :data:`RECORD_FIELDS`; ``created_at`` a datetime or its
        ISO text) in one transaction; a record
        whose ``request_id`` is already stored is skipped. Returns how many were given.
        Called by the usage writer thread; raises what the database raises."""
        rows = [{k: r.get(k) for k in RECORD_FIELDS} for r in records]
        for r in rows:  # a record read back from a spill file carries its time as text
            if isinstance(r["created_at"], str):
                r["created_at"] = datetime.fromisoformat(r["created_at"])
        if not rows:
            return 0
        dialect = self.db.engine.dialect.name
        if dialect == "postgresql":
            from sqlalchemy.dialects.postgresql import insert as dialect_insert
        elif dialect == "sqlite":
            from sqlalchemy.dialects.sqlite import insert as dialect_insert
        else:  # pragma: no cover - the registry runs on SQLite or PostgreSQL
            dialect_insert = None
        with self.db.session() as s:
            if dialect_insert is None:
                ids = [r["request_id"] for r in rows]
                have = set(s.scalars(select(UsageRecord.request_id)
                                     .where(UsageRecord.request_id.in_(ids))))
                rows = [r for r in rows if r["request_id"] not in have]
                if rows:
                    s.execute(insert(UsageRecord), rows)
            else:
                s.execute(dialect_insert(UsageRecord).on_conflict_do_nothing(
                    index_elements=["request_id"]), rows)
        return len(rows)

    @staticmethod
    def _window(q, start: datetime | None, end: datetime | None):
        if start is not None:
            q = q.where(UsageRecord.created_at >= start)
        if end is not None:
            q = q.where(UsageRecord.created_at < end)
        return q

    def summary(self, *, tenant_id: int | None, start: datetime | None, end: datetime | None,
                group_by: Sequence[str], limit: int) -> tuple[list[dict[str, Any]], bool]:
        """Sums of requests, errors and tokens per group (``group_by`` ⊆ :data:`GROUP_KEYS`,
        in that order), of one tenant (or, with ``tenant_id`` None, every tenant), for
        records finished in ``[start, end)``. Returns at most ``limit`` groups (ordered by
        their keys) and whether more exist."""
        keys = [k for k in GROUP_KEYS if k in group_by or (k == "adapter" and "version" in group_by)]
        cols = [getattr(UsageRecord, _COLUMN_OF[k]).label(k) for k in keys]
        sums = [
            func.count().label("requests"),
            func.coalesce(func.sum(case((UsageRecord.error.is_not(None), 1), else_=0)), 0)
            .label("errors"),
            func.coalesce(func.sum(UsageRecord.prompt_tokens), 0).label("prompt_tokens"),
            func.coalesce(func.sum(UsageRecord.cached_tokens), 0).label("cached_tokens"),
            func.coalesce(func.sum(UsageRecord.completion_tokens), 0).label("completion_tokens"),
        ]
        q = self._window(select(*cols, *sums), start, end)
        if tenant_id is not None:
            q = q.where(UsageRecord.tenant_id == tenant_id)
        if cols:
            q = q.group_by(*cols).order_by(*cols)
        with self.db.session() as s:
            rows = [dict(r._mapping) for r in s.execute(q.limit(limit + 1))]
        for r in rows:
            for k in ("requests", "errors", "prompt_tokens", "cached_tokens", "completion_tokens"):
                r[k] = int(r[k] or 0)
            r["total_tokens"] = r["prompt_tokens"] + r["completion_tokens"]
        return rows[:limit], len(rows) > limit

    def version_stats(self, *, since: datetime, tenant_id: int | None = None,
                      adapter: str | None = None) -> dict[tuple[int | None, str, int], VersionStats]:
        """Per ``(tenant id, adapter, version)`` numbers of the records finished since
        ``since`` (one tenant's adapter, or every adapter version when both are None):
        sums over every record, percentiles over the most recent :data:`MAX_SAMPLE`."""
        where = [UsageRecord.created_at >= since, UsageRecord.version.is_not(None),
                 UsageRecord.adapter.is_not(None)]
        if tenant_id is not None:
            where.append(UsageRecord.tenant_id == tenant_id)
        if adapter is not None:
            where.append(UsageRecord.adapter == adapter)
        group = (UsageRecord.tenant_id, UsageRecord.adapter, UsageRecord.version)
        totals = select(*group, func.count(),
                        func.sum(case((UsageRecord.error.is_not(None), 1), else_=0)),
                        func.sum(UsageRecord.prompt_tokens), func.sum(UsageRecord.cached_tokens),
                        func.sum(UsageRecord.completion_tokens)).where(*where).group_by(*group)
        out: dict[tuple[int | None, str, int], VersionStats] = {}
        with self.db.session() as s:
            for tid, name, version, n, errors, prompt, cached, completion in s.execute(totals):
                out[(tid, name, version)] = VersionStats(
                    int(n), int(errors or 0), int(prompt or 0), int(cached or 0),
                    int(completion or 0))
            for key, stats in out.items():
                lat = s.execute(
                    select(UsageRecord.ttft_ms, UsageRecord.tpot_ms)
                    .where(*where, UsageRecord.tenant_id == key[0], UsageRecord.adapter == key[1],
                           UsageRecord.version == key[2], UsageRecord.ttft_ms.is_not(None))
                    .order_by(UsageRecord.created_at.desc()).limit(MAX_SAMPLE)).all()
                ttft = sorted(t for t, _ in lat)
                tpot = sorted(t for _, t in lat if t is not None)
                stats.ttft_ms = {f"p{p}": percentile(ttft, p) for p in PERCENTILES}
                stats.tpot_ms = {f"p{p}": percentile(tpot, p) for p in PERCENTILES}
        return out

    def prune(self, before: datetime) -> int:
        """Delete the records finished before ``before`` (the retention); returns how many."""
        with self.db.session() as s:
            return s.execute(delete(UsageRecord).where(UsageRecord.created_at < before)).rowcount
