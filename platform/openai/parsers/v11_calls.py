"""The v11+ Mistral call segment: ``name[ARGS]{...}`` or ``name{...}``."""

from __future__ import annotations

import json

ARGS = "[ARGS]"


def split_v11_call(segment: str, closed: bool) -> tuple[str, str | None]:
    """``(name, raw_arguments)`` of the text after one ``[TOOL_CALLS]``.

    The name ends at ``[ARGS]`` (dropped) or at the first ``{`` (kept, it opens the
    arguments). ``raw_arguments`` is ``None`` while the name may still grow: no
    separator yet and no later marker (``closed``) ending the call.
    """
    args_at = segment.find(ARGS)
    brace_at = segment.find("{")
    if args_at != -1 and (brace_at == -1 or args_at < brace_at):
        return segment[:args_at], segment[args_at + len(ARGS) :]
    if brace_at != -1:
        return segment[:brace_at], segment[brace_at:]
    return (segment, "") if closed else (segment, None)


def first_json_value(raw_arguments: str) -> str:
    """The first complete JSON value as written (text after it dropped); ``"{}"`` for
    nothing; the stripped text itself when it is not JSON."""
    stripped = raw_arguments.strip()
    if not stripped:
        return "{}"
    try:
        _, end = json.JSONDecoder().raw_decode(stripped)
    except json.JSONDecodeError:
        return stripped
    return stripped[:end]
