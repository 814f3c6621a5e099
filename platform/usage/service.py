"""Reading usage back: the query (``start``, ``end``, ``group_by``, ``limit``) checked into
:class:`UsageQuery`, one tenant's sums (``GET /v1/usage``), every tenant's (``GET
/admin/usage``, JSON or CSV). This server's finished requests are flushed to the ledger
first, so a client sees its own last request; other servers' arrive within their flush
interval. Reads run in the database bulkhead."""

from __future__ import annotations

import csv
import io
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import date, datetime, time, timezone
from typing import TYPE_CHECKING, Any

from starlette.concurrency import run_in_threadpool

from loramux.platform.bulkheads import Dependencies
from loramux.platform.errors import BadRequest, NotFound
from loramux.registry.usage import GROUP_KEYS

if TYPE_CHECKING:
    from loramux.registry.service import RegistryService

SUMS = ("requests", "errors", "prompt_tokens", "cached_tokens", "completion_tokens",
        "total_tokens")
MAX_LIMIT = 10_000


def parse_time(value: str | None, param: str) -> datetime | None:
    """Unix seconds (``1764547200``) or ISO 8601 (``2026-12-01``, ``2026-12-01T10:00:00Z``;
    without a zone: UTC); None stays None."""
    if value is None or value.strip() == "":
        return None
    text = value.strip()
    try:
        if text.replace(".", "", 1).isdigit():
            return datetime.fromtimestamp(float(text), timezone.utc)
        if len(text) == 10:
            return datetime.combine(date.fromisoformat(text), time(), timezone.utc)
        parsed = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except (ValueError, OverflowError, OSError):
        raise BadRequest(f"{param} must be unix seconds or an ISO 8601 date or time, got "
                         f"{text[:40]!r}", param=param, code="invalid_parameter") from None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=timezone.utc)


@dataclass(frozen=True)
class UsageQuery:
    """A checked usage query: records finished in ``[start, end)``, grouped by
    ``group_by`` (keys of :data:`~loramux.registry.usage.GROUP_KEYS`), at most ``limit``
    groups."""

    start: datetime | None
    end: datetime | None
    group_by: tuple[str, ...]
    limit: int

    @classmethod
    def parse(cls, start: str | None, end: str | None, group_by: Sequence[str], limit: int,
              allowed: Sequence[str]) -> UsageQuery:
        """From the query string (``group_by`` repeated or comma-separated); 400 naming
        the parameter for anything it cannot mean."""
        keys: list[str] = []
        for item in group_by:
            for key in (k.strip() for k in item.split(",")):
                if not key:
                    continue
                if key not in allowed:
                    raise BadRequest(f"group_by {key[:40]!r} is not one of {', '.join(allowed)}",
                                     param="group_by", code="invalid_parameter")
                if key not in keys:
                    keys.append(key)
        if not 1 <= limit <= MAX_LIMIT:
            raise BadRequest(f"limit must be between 1 and {MAX_LIMIT}", param="limit",
                             code="invalid_parameter")
        first, last = parse_time(start, "start"), parse_time(end, "end")
        if first is not None and last is not None and first >= last:
            raise BadRequest("start must be before end", param="start", code="invalid_parameter")
        if "version" in keys and "adapter" not in keys:
            keys.insert(keys.index("version"), "adapter")  # a version is one adapter's
        return cls(first, last, tuple(keys), limit)


class UsageService:
    """Usage sums of one tenant or of all, over the registry's ledger."""

    def __init__(self, registry: RegistryService, deps: Dependencies,
                 flush: Callable[[], object] | None = None) -> None:
        self.registry = registry
        self.deps = deps
        self.flush = flush

    async def _summary(self, tenant_id: int | None, q: UsageQuery):
        if self.flush is not None:
            await run_in_threadpool(self.flush)
        return await self.deps.db.call(
            self.registry.usage.summary, tenant_id=tenant_id, start=q.start, end=q.end,
            group_by=[k for k in GROUP_KEYS if k in q.group_by], limit=q.limit)

    @staticmethod
    def _rows(rows: list[dict[str, Any]], q: UsageQuery) -> list[dict[str, Any]]:
        """Each group: its keys in the order asked, then the sums."""
        return [{**{k: r[k] for k in q.group_by}, **{k: r[k] for k in SUMS}} for r in rows]

    async def tenant(self, tenant_id: int, q: UsageQuery) -> dict[str, Any]:
        rows, more = await self._summary(tenant_id, q)
        return {"object": "list", "data": self._rows(rows, q), "has_more": more}

    async def all_tenants(self, q: UsageQuery, tenant: str | None) -> dict[str, Any]:
        """Every tenant's sums (``tenant`` is the tenant's name, for the ones that still
        exist); ``tenant`` given: that tenant's only (404 when there is none)."""
        tenants = await self.deps.db.call(self.registry.list_tenants)
        names = {t.id: t.name for t in tenants}
        tenant_id = None
        if tenant:
            tenant_id = next((i for i, n in names.items() if n == tenant), None)
            if tenant_id is None:
                raise NotFound(f"no tenant {tenant[:60]!r}", param="tenant",
                               code="tenant_not_found")
        rows, more = await self._summary(tenant_id, q)
        if "tenant" in q.group_by:
            for r in rows:
                r["tenant_id"], r["tenant"] = r["tenant"], names.get(r["tenant"])
        data = self._rows(rows, q)
        if "tenant" in q.group_by:
            for out, r in zip(data, rows, strict=True):
                out["tenant_id"] = r["tenant_id"]
        return {"object": "list", "data": data, "has_more": more}


def columns(q: UsageQuery, *, admin: bool) -> list[str]:
    """The fields of a usage row for ``q``, in order."""
    extra = ["tenant_id"] if admin and "tenant" in q.group_by else []
    return [*q.group_by, *SUMS, *extra]


def to_csv(rows: list[dict[str, Any]], fields: list[str]) -> str:
    """The rows as CSV under a header line of ``fields``."""
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=fields, lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    return out.getvalue()
