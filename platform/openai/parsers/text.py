"""Small text helpers the parsers share (marker hold-back, JSON completeness)."""

from __future__ import annotations

import json


def partial_tag_overlap(text: str, tag: str) -> int:
    """Length of the longest proper prefix of ``tag`` that ends ``text``.

    A streaming parser holds that many characters back: they may be the start of
    the marker (``"...<tool_"`` against ``"<tool_call>"`` gives 6).
    """
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


def longest_tag_overlap(text: str, tags: tuple[str, ...]) -> int:
    """The largest :func:`partial_tag_overlap` of ``text`` against any of ``tags``."""
    return max((partial_tag_overlap(text, tag) for tag in tags), default=0)


def is_complete_json(text: str) -> bool:
    """Whether ``text`` is one whole JSON value."""
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return False
    return True


def common_prefix(a: str, b: str) -> str:
    """The longest common prefix of two strings."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return a[:i]
