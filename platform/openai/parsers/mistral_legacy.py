"""The pre-v11 Mistral tool-call body: a JSON array of ``{"name", "arguments"}`` objects
(or one bare object) after ``[TOOL_CALLS]``.

:func:`legacy_function_calls` decodes a complete body as vLLM does;
:func:`scan_call_array` locates each call's name and arguments in a body that is
still being generated, for streaming.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from loramux.platform.openai.parsers.types import FunctionCall

_ARRAY_OF_OBJECTS = re.compile(r"\[{.*}\]", re.DOTALL)


def decode_first_json(text: str) -> Any:
    """The first JSON value of ``text`` (trailing text ignored), else the first
    ``[{...}]`` span in it, else ``None``."""
    try:
        return json.JSONDecoder().raw_decode(text)[0]
    except json.JSONDecodeError:
        pass
    found = _ARRAY_OF_OBJECTS.findall(text)
    if found:
        try:
            return json.loads(found[0])
        except json.JSONDecodeError:
            return None
    return None


def legacy_function_calls(parsed: Any) -> list[FunctionCall]:
    """The calls of a decoded body: a bare object is one call, entries that are not
    call objects are skipped, a missing name becomes ``""``, string arguments stay."""
    if isinstance(parsed, dict):
        parsed = [parsed]
    if not isinstance(parsed, list):
        return []
    calls: list[FunctionCall] = []
    for item in parsed:
        if not isinstance(item, dict) or not ("name" in item or "arguments" in item):
            continue
        name = item.get("name")
        arguments = item.get("arguments")
        if arguments is None:
            arguments = "{}"
        elif not isinstance(arguments, str):
            arguments = json.dumps(arguments, ensure_ascii=False)
        calls.append(FunctionCall(name=name if isinstance(name, str) else "", arguments=arguments))
    return calls


@dataclass
class CallSpan:
    """Where one call sits in a (possibly unfinished) body; offsets into the body."""

    name: str | None = None
    args_start: int | None = None
    args_end: int | None = None  # None while the value is still being generated
    args_is_string: bool = False


@dataclass
class BodyScan:
    calls: list[CallSpan]
    end: int | None  # offset just past the closing ] (or bare }), None if still open


def scan_call_array(body: str) -> BodyScan:
    """One string- and nesting-aware pass over the body."""
    calls: list[CallSpan] = []
    depth = 0
    bare = False
    element_depth = 2
    in_string = False
    string_start = 0
    escaped = False
    key: str | None = None
    expect_value = False
    current: CallSpan | None = None
    value_depth_start: int | None = None
    for i, ch in enumerate(body):
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
                if depth == element_depth and current is not None:
                    text = body[string_start : i + 1]
                    if expect_value:
                        if key == "name":
                            current.name = json.loads(text)
                        elif key == "arguments":
                            current.args_end = i + 1
                        expect_value = False
                    else:
                        key = json.loads(text)
            continue
        if ch.isspace():
            continue
        if ch == '"':
            in_string = True
            string_start = i
            if (
                depth == element_depth
                and current is not None
                and expect_value
                and key == "arguments"
            ):
                current.args_start = i
                current.args_is_string = True
            continue
        if ch in "[{":
            if depth == 0:
                bare = ch == "{"
                element_depth = 1 if bare else 2
                if bare:
                    current = CallSpan()
                    calls.append(current)
            elif depth == 1 and not bare and ch == "{":
                current = CallSpan()
                calls.append(current)
                key = None
            elif depth == element_depth and current is not None and expect_value:
                if key == "arguments":
                    current.args_start = i
                value_depth_start = depth
            depth += 1
            continue
        if ch in "]}":
            depth -= 1
            if value_depth_start is not None and depth == value_depth_start:
                if key == "arguments" and current is not None:
                    current.args_end = i + 1
                value_depth_start = None
                expect_value = False
            if depth == 0:
                return BodyScan(calls, i + 1)
            continue
        if depth == element_depth and current is not None:
            if ch == ":":
                expect_value = True
            elif ch == ",":
                expect_value = False
                key = None
    return BodyScan(calls, None)
