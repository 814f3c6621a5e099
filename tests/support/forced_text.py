"""Forcing a random model to write a given text: a regex that matches it literally (for
``structured_outputs.regex``; xgrammar's regex dialect, which knows no ``\\ `` escape)."""

from __future__ import annotations

_SPECIAL = set(".^$*+?{}[]\\|()")


def regex_literal(text: str) -> str:
    """A regex matching exactly ``text``."""
    return "".join("\\" + c if c in _SPECIAL else ("\\n" if c == "\n" else c) for c in text)
