"""Parse the prefix of a JSON value that a model is still generating.

:func:`loads_prefix` returns what the text says so far: open objects and arrays are
closed, an unfinished string is kept as far as it goes (or left out when
``partial_strings`` is off, as vLLM's streaming parsers do until a tool's name is
complete), and a member whose value has not started is left out. An unfinished
number is kept when it already reads as a number; an unfinished ``true``/``false``/
``null`` is left out.
"""

from __future__ import annotations

import json
import re
from typing import Any

_NUMBER = re.compile(r"-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][+-]?\d+)?")
_WS = " \t\n\r"
_UNFINISHED_UNICODE = re.compile(r"\\u[0-9a-fA-F]{0,3}$")


class MalformedJSON(ValueError):
    """The text is not the start of a JSON value."""


class _Incomplete(Exception):
    """Raised inside the parser when the text ends before the current value does."""


_MISSING = object()


def loads_prefix(text: str, partial_strings: bool = True) -> tuple[Any, int]:
    """``(value, end)``: the value the text starts with, and where it ended.

    ``end`` is ``len(text)`` when the value is unfinished; otherwise the offset just
    after it (extra text after a complete value is left to the caller).
    """
    parser = _PrefixParser(text, partial_strings)
    pos = parser.skip_ws(0)
    if pos >= len(text):
        raise MalformedJSON("no JSON value yet")
    value, end, complete = parser.value(pos)
    if value is _MISSING:
        raise MalformedJSON("no JSON value yet")
    return value, end if complete else len(text)


class _PrefixParser:
    def __init__(self, text: str, partial_strings: bool) -> None:
        self.text = text
        self.partial_strings = partial_strings

    def skip_ws(self, pos: int) -> int:
        while pos < len(self.text) and self.text[pos] in _WS:
            pos += 1
        return pos

    def value(self, pos: int) -> tuple[Any, int, bool]:
        """``(value or _MISSING, end, complete)`` for the value starting at ``pos``."""
        ch = self.text[pos]
        if ch == "{":
            return self.obj(pos + 1)
        if ch == "[":
            return self.array(pos + 1)
        if ch == '"':
            value, end, complete = self.string(pos)
            if not complete and not self.partial_strings:
                return _MISSING, end, False
            return value, end, complete
        for literal, result in (("true", True), ("false", False), ("null", None)):
            if self.text.startswith(literal, pos):
                return result, pos + len(literal), True
            if literal.startswith(self.text[pos:]):
                return _MISSING, len(self.text), False
        match = _NUMBER.match(self.text, pos)
        if match is None:
            if self.text[pos] == "-" and pos + 1 == len(self.text):
                return _MISSING, len(self.text), False
            raise MalformedJSON(f"unexpected {ch!r} at {pos}")
        end = match.end()
        number = json.loads(match.group())
        if end == len(self.text):
            return number, end, False
        if self.text[end] in ".eE":
            rest = self.text[end:]
            if re.fullmatch(r"\.|[eE][+-]?|\.\d*[eE][+-]?", rest):
                return number, len(self.text), False
        return number, end, True

    def string(self, pos: int) -> tuple[str, int, bool]:
        i = pos + 1
        while i < len(self.text):
            ch = self.text[i]
            if ch == "\\":
                i += 2
                continue
            if ch == '"':
                return json.loads(self.text[pos : i + 1]), i + 1, True
            i += 1
        body = _trim_unfinished_escape(self.text[pos + 1 :])
        try:
            return json.loads(f'"{body}"'), len(self.text), False
        except json.JSONDecodeError:
            return "", len(self.text), False

    def obj(self, pos: int) -> tuple[dict, int, bool]:
        result: dict[str, Any] = {}
        pos = self.skip_ws(pos)
        if pos < len(self.text) and self.text[pos] == "}":
            return result, pos + 1, True
        while True:
            pos = self.skip_ws(pos)
            if pos >= len(self.text):
                return result, pos, False
            if self.text[pos] != '"':
                raise MalformedJSON(f"expected a key at {pos}")
            key, pos, complete = self.string(pos)
            if not complete:
                return result, pos, False
            pos = self.skip_ws(pos)
            if pos >= len(self.text):
                return result, pos, False
            if self.text[pos] != ":":
                raise MalformedJSON(f"expected ':' at {pos}")
            pos = self.skip_ws(pos + 1)
            if pos >= len(self.text):
                return result, pos, False
            value, pos, complete = self.value(pos)
            if value is not _MISSING:
                result[key] = value
            if not complete:
                return result, pos, False
            pos = self.skip_ws(pos)
            if pos >= len(self.text):
                return result, pos, False
            if self.text[pos] == "}":
                return result, pos + 1, True
            if self.text[pos] != ",":
                raise MalformedJSON(f"expected ',' or '}}' at {pos}")
            pos += 1

    def array(self, pos: int) -> tuple[list, int, bool]:
        result: list[Any] = []
        pos = self.skip_ws(pos)
        if pos < len(self.text) and self.text[pos] == "]":
            return result, pos + 1, True
        while True:
            pos = self.skip_ws(pos)
            if pos >= len(self.text):
                return result, pos, False
            value, pos, complete = self.value(pos)
            if value is not _MISSING:
                result.append(value)
            if not complete:
                return result, pos, False
            pos = self.skip_ws(pos)
            if pos >= len(self.text):
                return result, pos, False
            if self.text[pos] == "]":
                return result, pos + 1, True
            if self.text[pos] != ",":
                raise MalformedJSON(f"expected ',' or ']' at {pos}")
            pos += 1


def _trim_unfinished_escape(body: str) -> str:
    """Cut an escape sequence the model has not finished (``\\`` or ``\\u12``)."""
    run = len(body) - len(body.rstrip("\\"))
    if run % 2 == 1:
        return body[:-1]
    match = _UNFINISHED_UNICODE.search(body)
    if match is not None:
        before = body[: match.start()]
        if (len(before) - len(before.rstrip("\\"))) % 2 == 0:
            return before
    return body
