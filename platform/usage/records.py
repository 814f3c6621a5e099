"""One finished request's usage record (a plain dict of the ledger's columns), built from
what the request path knows when it ends. Pure."""

from __future__ import annotations

import time
from collections.abc import Sequence
from datetime import datetime, timezone
from typing import Any, Protocol


class TrackLike(Protocol):
    """One engine request's timing and counts (``openai.streaming.Track``)."""

    start: float
    first: float | None
    end: float | None
    prompt_tokens: int
    output_tokens: int
    cached_tokens: int
    finish_reason: str | None


def _ms(seconds: float | None) -> float | None:
    return round(seconds * 1000, 3) if seconds is not None else None


def _cut(value: str | None, size: int) -> str | None:
    return value[:size] if value is not None else None


def usage_record(*, request_id: str, tenant_id: int | None, key_prefix: str | None,
                 adapter: str | None, version: int | None, endpoint: str,
                 tracks: Sequence[TrackLike], usage: dict[str, int] | None,
                 error: str | None, now: float | None = None) -> dict[str, Any]:
    """The record of one request. ``usage`` is the usage object the client received
    (prompt and completion tokens; None when it received none: the counts come from the
    engine's outputs); ``error`` is the error code (or ``cancelled``), None on success."""
    end = time.monotonic() if now is None else now
    started = min((t.start for t in tracks), default=end)
    finished = max((t.end for t in tracks if t.end is not None), default=end)
    firsts = [t.first - t.start for t in tracks if t.first is not None]
    tpots = [(t.end - t.first) / (t.output_tokens - 1) for t in tracks
             if t.first is not None and t.end is not None and t.output_tokens > 1]
    reasons = {t.finish_reason for t in tracks if t.finish_reason}
    if usage is not None:
        prompt, completion = usage["prompt_tokens"], usage["completion_tokens"]
    else:
        prompt = sum(t.prompt_tokens for t in tracks)
        completion = sum(t.output_tokens for t in tracks)
    when = datetime.now(timezone.utc)
    return {
        "request_id": _cut(request_id, 80), "tenant_id": tenant_id,
        "key_prefix": _cut(key_prefix, 16), "adapter": _cut(adapter, 128), "version": version,
        "endpoint": _cut(endpoint, 16), "prompt_tokens": int(prompt),
        "cached_tokens": int(sum(t.cached_tokens for t in tracks)),
        "completion_tokens": int(completion),
        "finish_reason": None if error else _cut(
            reasons.pop() if len(reasons) == 1 else ("mixed" if reasons else None), 32),
        "error": _cut(error, 64),
        "duration_ms": _ms(max(finished, started) - started) or 0.0,
        "ttft_ms": _ms(min(firsts)) if firsts else None,
        "tpot_ms": _ms(sum(tpots) / len(tpots)) if tpots else None,
        "day": when.strftime("%Y-%m-%d"), "created_at": when,
    }
