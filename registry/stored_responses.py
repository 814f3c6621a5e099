"""Stored Responses API responses (``stored_responses``), per tenant: :class:`StoredResponses`,
a part of ``RegistryService``.

A row holds the response object as it was returned and the conversation it ends (the chat
messages it continued plus its own output), so ``previous_response_id`` picks the thread up.
Every query is scoped to one tenant: another tenant's id reads exactly like a missing one.

What a tenant may keep is bounded by :class:`ResponseStoreLimits` (settings fields, one
source of truth): a response bigger than ``max_stored_response_bytes`` is not stored (the
caller is told; the answer itself is never refused), and past ``max_stored_responses`` or
``max_stored_response_bytes_total`` the tenant's oldest responses are evicted, oldest
first, in the same transaction that stores the new one. Eviction, not refusal: a client
continuing a conversation should not start failing because old ones piled up, and
OpenAI's own store expires responses too (after 30 days).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from datetime import datetime
from typing import TYPE_CHECKING, Any

from sqlalchemy import delete, func, select

from loramux.registry.models import StoredResponse, utcnow

if TYPE_CHECKING:
    from loramux.registry.db import Database


@dataclass(frozen=True)
class ResponseStoreLimits:
    """What one tenant may keep of ``/v1/responses`` results (``store: true``)."""

    max_stored_response_bytes: int = field(default=2_000_000, metadata={"doc": (
        "Largest stored Responses API response (its body plus the conversation it ends, as "
        "JSON bytes); a bigger one is answered but not stored.")})
    max_stored_responses: int = field(default=10_000, metadata={"doc": (
        "Most stored Responses API responses per tenant; past it the oldest are evicted.")})
    max_stored_response_bytes_total: int = field(default=512 * 2**20, metadata={"doc": (
        "Most bytes of stored Responses API responses per tenant; past it the oldest are "
        "evicted.")})

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{f.name} must be an integer >= 1, got {value!r}")


@dataclass(frozen=True)
class StoredResponseRecord:
    """One stored response, read back."""

    id: str
    tenant_id: int
    model: str
    previous_response_id: str | None
    body: dict[str, Any]
    conversation: dict[str, Any]
    size_bytes: int
    created_at: datetime


@dataclass(frozen=True)
class StoreResult:
    """What :meth:`StoredResponses.store_response` did."""

    stored: bool
    reason: str | None = None
    """Why it was not stored (too large)."""
    evicted: tuple[str, ...] = ()
    """The tenant's older responses removed to make room."""


def stored_size(body: dict[str, Any], conversation: dict[str, Any]) -> int:
    """The bytes a response costs its tenant: its body and conversation as compact JSON."""
    return sum(len(json.dumps(x, separators=(",", ":"), ensure_ascii=False).encode())
               for x in (body, conversation))


class StoredResponses:
    """The ``stored_responses`` table of one database. Thread-safe (a session per call)."""

    def __init__(self, db: Database) -> None:
        self.db = db

    def store_response(self, tenant_id: int, response_id: str, *, model: str,
                       previous_response_id: str | None, body: dict[str, Any],
                       conversation: dict[str, Any],
                       limits: ResponseStoreLimits | None = None) -> StoreResult:
        """Store one response (called as a ``store: true`` response ends, in the database
        bulkhead). Too large: nothing stored, ``stored`` False. Past the tenant's count or
        bytes cap: its oldest responses are evicted in the same transaction."""
        limits = limits or ResponseStoreLimits()
        size = stored_size(body, conversation)
        if size > limits.max_stored_response_bytes:
            return StoreResult(False, f"the response and its conversation take {size} bytes, "
                                      f"more than max_stored_response_bytes "
                                      f"({limits.max_stored_response_bytes})")
        with self.db.session() as s:
            s.add(StoredResponse(id=response_id, tenant_id=tenant_id, model=model[:256],
                                 previous_response_id=previous_response_id, body=body,
                                 conversation=conversation, size_bytes=size,
                                 created_at=utcnow()))
            s.flush()
            count, total = s.execute(
                select(func.count(), func.coalesce(func.sum(StoredResponse.size_bytes), 0))
                .where(StoredResponse.tenant_id == tenant_id)).one()
            if count <= limits.max_stored_responses and total <= limits.max_stored_response_bytes_total:
                return StoreResult(True)
            rows = s.execute(
                select(StoredResponse.id, StoredResponse.size_bytes)
                .where(StoredResponse.tenant_id == tenant_id, StoredResponse.id != response_id)
                .order_by(StoredResponse.created_at.desc(), StoredResponse.id.desc())).all()
            kept, used, evicted = 1, size, []
            for rid, rsize in rows:  # newest first: keep while within both caps
                if kept < limits.max_stored_responses and used + rsize <= limits.max_stored_response_bytes_total:
                    kept, used = kept + 1, used + rsize
                else:
                    evicted.append(rid)
            if evicted:
                s.execute(delete(StoredResponse).where(StoredResponse.tenant_id == tenant_id,
                                                       StoredResponse.id.in_(evicted)))
        return StoreResult(True, evicted=tuple(evicted))

    def get_stored_response(self, tenant_id: int, response_id: str) -> StoredResponseRecord | None:
        """The tenant's stored response, or None (unknown, deleted, evicted, or another
        tenant's)."""
        with self.db.session() as s:
            row = s.execute(select(StoredResponse).where(
                StoredResponse.tenant_id == tenant_id, StoredResponse.id == response_id)
            ).scalar_one_or_none()
            if row is None:
                return None
            return StoredResponseRecord(row.id, row.tenant_id, row.model, row.previous_response_id,
                                        row.body, row.conversation, row.size_bytes, row.created_at)

    def delete_stored_response(self, tenant_id: int, response_id: str) -> bool:
        """Delete the tenant's stored response; False when it had none of that id."""
        with self.db.session() as s:
            result = s.execute(delete(StoredResponse).where(
                StoredResponse.tenant_id == tenant_id, StoredResponse.id == response_id))
            return bool(result.rowcount)

    def stored_response_usage(self, tenant_id: int) -> tuple[int, int]:
        """How many responses the tenant keeps and their bytes."""
        with self.db.session() as s:
            count, total = s.execute(
                select(func.count(), func.coalesce(func.sum(StoredResponse.size_bytes), 0))
                .where(StoredResponse.tenant_id == tenant_id)).one()
        return int(count), int(total)
