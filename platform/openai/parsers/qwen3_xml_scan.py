"""The Qwen3 XML tool-call grammar (vLLM's ``qwen3_config`` without its reasoning part):
a state machine over the format's markers, and the conversion of a call's
``<parameter=...>`` body into JSON arguments.

::

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Tokyo
    </parameter>
    </function>
    </tool_call>

Text between ``<tool_call>`` and ``<function=`` and between ``</function>`` and
``</tool_call>`` is dropped; ``<function=`` without ``<tool_call>`` also opens a call; a
marker with no meaning where it appears is plain text of the current part.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from enum import Enum

TOOL_START = "<tool_call>"
TOOL_END = "</tool_call>"
FUNC_PREFIX = "<function="
FUNC_END = "</function>"
PARAM_START = "<parameter="
PARAM_END = "</parameter>"
CLOSE_ANGLE = ">"

#: markers a streaming parser holds back while they may be half generated
HELD_MARKERS = (TOOL_START, TOOL_END, FUNC_PREFIX, FUNC_END, PARAM_START, PARAM_END)
_MARKERS = re.compile(
    "|".join(re.escape(m) for m in sorted((*HELD_MARKERS, CLOSE_ANGLE), key=len, reverse=True))
)


class _State(Enum):
    CONTENT = "content"
    PREAMBLE = "preamble"  # after <tool_call>, before <function=
    NAME = "name"
    ARGS = "args"
    BETWEEN = "between"  # after </function>, before </tool_call>


@dataclass
class ToolSlot:
    name: str = ""
    args: str = ""  # the raw <parameter=...> body
    ended: bool = False


@dataclass
class Scan:
    """What a text says so far: content pieces and the calls, in order.

    ``content_before`` is the content before the first call; ``content_after`` the
    content after it started (vLLM drops it from a non-streamed answer with calls).
    """

    content_before: str = ""
    content_after: str = ""
    slots: list[ToolSlot] = field(default_factory=list)


_TRANSITIONS: dict[tuple[_State, str], tuple[_State, str]] = {
    # (state, marker) -> (next state, action); action: "" / "start" / "end" / "arg"
    (_State.CONTENT, TOOL_START): (_State.PREAMBLE, "start"),
    (_State.CONTENT, FUNC_PREFIX): (_State.NAME, "start"),
    (_State.PREAMBLE, TOOL_END): (_State.CONTENT, "end"),
    (_State.PREAMBLE, FUNC_PREFIX): (_State.NAME, ""),
    (_State.NAME, CLOSE_ANGLE): (_State.ARGS, ""),
    (_State.NAME, FUNC_END): (_State.BETWEEN, "end"),
    (_State.ARGS, FUNC_END): (_State.BETWEEN, "end"),
    (_State.ARGS, PARAM_START): (_State.ARGS, "arg"),
    (_State.ARGS, PARAM_END): (_State.ARGS, "arg"),
    (_State.BETWEEN, TOOL_END): (_State.CONTENT, ""),
    (_State.BETWEEN, TOOL_START): (_State.PREAMBLE, "start"),
    (_State.BETWEEN, FUNC_PREFIX): (_State.NAME, "start"),
}


def scan(text: str) -> Scan:
    """Run the grammar over ``text`` (the caller holds back a half-generated marker)."""
    result = Scan()
    state = _State.CONTENT
    pos = 0

    def emit(piece: str) -> None:
        if not piece:
            return
        if state is _State.CONTENT:
            if result.slots:
                result.content_after += piece
            else:
                result.content_before += piece
        elif state is _State.NAME:
            result.slots[-1].name += piece
        elif state is _State.ARGS:
            result.slots[-1].args += piece

    for match in _MARKERS.finditer(text):
        emit(text[pos : match.start()])
        pos = match.end()
        transition = _TRANSITIONS.get((state, match.group()))
        if transition is None:
            emit(match.group())
            continue
        state, action = transition
        if action == "start":
            result.slots.append(ToolSlot())
        elif action == "end":
            result.slots[-1].ended = True
        elif action == "arg":
            result.slots[-1].args += match.group()
    emit(text[pos:])
    return result


_PARAM = re.compile(
    r"<\s*parameter\s*=\s*([^>]*)>(.*?)(?:<\s*/\s*parameter\s*>|(?=<\s*parameter\s*=))",
    re.DOTALL,
)
_PARTIAL_PARAM = re.compile(r"<\s*parameter\s*=\s*([^>]+)>(.*)$", re.DOTALL)


def _trim_wrapping_newlines(value: str) -> str:
    if value.startswith("\n"):
        value = value[1:]
    if value.endswith("\n"):
        value = value[:-1]
    return value


def arguments_json(raw_args: str, partial: bool) -> str:
    """The JSON object of a call's parameters, every value a string (one wrapping
    newline trimmed); ``partial`` also reads a parameter whose end has not come."""
    params: dict[str, str] = {}
    for match in _PARAM.finditer(raw_args):
        params[match.group(1)] = _trim_wrapping_newlines(match.group(2))
    if partial:
        match = _PARTIAL_PARAM.search(_PARAM.sub("", raw_args))
        if match and match.group(1):
            params[match.group(1)] = _trim_wrapping_newlines(match.group(2))
    return json.dumps(params, ensure_ascii=False)


def safe_arguments_prefix(args_json: str, string_keys: set[str] | None) -> str:
    """The part of partial arguments JSON that cannot change as generation goes on:
    up to the last value, plus that value's text when it is a string that stays one
    (a key in ``string_keys``, or any key when ``None``); never its closing quote."""
    last_colon = -1
    last_key: str | None = None
    pending_key: str | None = None
    in_string = escape = False
    string_start = -1
    depth = 0
    for i, c in enumerate(args_json):
        if escape:
            escape = False
            continue
        if in_string:
            if c == "\\":
                escape = True
            elif c == '"':
                in_string = False
                if depth == 1 and string_start >= 0:
                    pending_key = args_json[string_start + 1 : i]
            continue
        if c == '"':
            in_string = True
            string_start = i
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
        elif c == ":" and depth == 1:
            last_colon = i
            last_key = pending_key
            pending_key = None
    if last_colon < 0:
        return ""
    end = last_colon + 1
    while end < len(args_json) and args_json[end] in " \t\n\r":
        end += 1
    if end >= len(args_json) or args_json[end] != '"':
        return args_json[:end]
    if string_keys is not None and last_key not in string_keys:
        return args_json[:end]
    escape = False
    for i in range(end + 1, len(args_json)):
        c = args_json[i]
        if escape:
            escape = False
        elif c == "\\":
            escape = True
        elif c == '"':
            return args_json[:i]
    return args_json
