"""What a gateway reads from an inference request's JSON body (it holds no tokenizer and
parses nothing else): the prompt text for prefix hashes, the cost charged to the tenant's
limits before it runs, and the tokens an answer's ``usage`` reports afterwards."""

from __future__ import annotations

import json
from typing import Any

from loramux.platform.limits.tenant import RequestCost

DEFAULT_MAX_TOKENS = 16
"""The completion budget assumed when a request names none (OpenAI's completions default)."""


def prompt_text(body: dict) -> str:
    """The text the prefix hashes are computed over: the prompt, or the messages' contents
    (a Responses API request: its instructions and input items)."""
    if isinstance(body.get("prompt"), str):
        return body["prompt"]
    messages = body.get("messages")
    if messages is None and "input" in body:
        items = body["input"]
        messages = [{"content": items}] if isinstance(items, str) else items
        if isinstance(body.get("instructions"), str):
            messages = [{"content": body["instructions"]}, *(messages or [])]
    parts = []
    for m in messages or ():
        if isinstance(m, dict):
            c = m.get("content", m.get("output", m.get("arguments")))
            parts.append(c if isinstance(c, str) else json.dumps(c, sort_keys=True))
    return "\n".join(parts)


def _count(value: Any, default: int) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else default


def request_cost(body: dict) -> RequestCost:
    """What a request charges before it runs. The gateway holds no tokenizer: the prompt
    counts one token per 4 bytes of its text (corrected from ``usage`` afterwards)."""
    n = _count(body.get("n"), 1)
    best_of = _count(body.get("best_of"), n)
    max_tokens = _count(body.get("max_completion_tokens") or body.get("max_tokens")
                        or body.get("max_output_tokens"), DEFAULT_MAX_TOKENS)
    return RequestCost.estimate(len(prompt_text(body).encode()) // 4 + 1, max_tokens, n, best_of)


def usage_tokens(content: bytes) -> int | None:
    """``usage.total_tokens`` of a JSON answer, if it has one."""
    try:
        total = json.loads(content)["usage"]["total_tokens"]
    except (ValueError, KeyError, TypeError):
        return None
    return total if isinstance(total, int) else None
