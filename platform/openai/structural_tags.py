"""Structural tags (xgrammar) that constrain tool calls to a model's own call format.

A parser names its format with ``structural_tag_model``: ``hermes`` is built here (as
vLLM builds it: ``<tool_call>{"name": "f", "arguments": {...}}</tool_call>``, with or
without newlines inside the tags); the others (``llama``, ``qwen_3_coder``, …) are
xgrammar's builtin formats. Argument schemas follow ``--tool-strict-level``: a tool's
``parameters`` are pinned when it is marked ``"strict": true`` (every tool at
``parameter``), otherwise its arguments are any JSON object. The thought of a reasoning
model is not part of the tag: the engine applies the grammar after it (``reasoning_end``).
"""

from __future__ import annotations

from typing import Any

import xgrammar as xgr
from xgrammar.structural_tag import (
    AnyTextFormat,
    JSONSchemaFormat,
    StructuralTag,
    TagFormat,
    TagsWithSeparatorFormat,
    TriggeredTagsFormat,
)

_HERMES_TAGS = (('<tool_call>\n{"name": "', "}\n</tool_call>"), ('<tool_call>{"name": "', "}</tool_call>"))
_ANY_OBJECT: dict[str, Any] = {"type": "object"}


def _pinned(tool: Any, strict_level: str) -> bool:
    """Whether the tool's arguments must follow its ``parameters`` schema."""
    return tool.function.strict is True or strict_level == "parameter"


def _schema(tool: Any, strict_level: str) -> dict[str, Any]:
    if _pinned(tool, strict_level) and tool.function.parameters:
        return tool.function.parameters
    return _ANY_OBJECT


def _hermes(tools: list[Any], choice: str, parallel: bool, strict_level: str) -> StructuralTag:
    tags = [TagFormat(begin=begin + tool.function.name + '", "arguments": ',
                      content=JSONSchemaFormat(json_schema=_schema(tool, strict_level)), end=end)
            for tool in tools for begin, end in _HERMES_TAGS]
    if choice == "auto":
        fmt: Any = (TriggeredTagsFormat(triggers=["<tool_call>"], tags=tags,
                                        stop_after_first=not parallel)
                    if tags else AnyTextFormat())
    else:
        fmt = TagsWithSeparatorFormat(tags=tags, separator="", at_least_one=True,
                                      stop_after_first=choice == "named" or not parallel)
    return StructuralTag(format=fmt)


def _xgrammar_tool(tool: Any, strict_level: str) -> dict[str, Any]:
    function = tool.function
    out: dict[str, Any] = {"name": function.name, "strict": _pinned(tool, strict_level)}
    if function.parameters is not None:
        out["parameters"] = function.parameters
    return {"type": "function", "function": out}


def tool_call_structural_tag(model: str, tools: list[Any], choice: str, named: str | None,
                             parallel: bool, strict_level: str) -> dict[str, Any]:
    """The structural tag (as a dict) constraining ``choice`` (``auto`` | ``required`` |
    ``named``) over ``tools`` in ``model``'s format; ``ValueError`` for an unknown format."""
    if named is not None:
        tools = [t for t in tools if t.function.name == named]
    if model == "hermes":
        return _hermes(tools, choice, parallel, strict_level).model_dump(mode="json")
    tool_choice: Any = choice
    if choice == "named":
        tool_choice = {"type": "function", "function": {"name": named}}
    tag = xgr.get_model_structural_tag(
        model, tools=[_xgrammar_tool(t, strict_level) for t in tools], tool_choice=tool_choice,
        reasoning="disabled", parallel_tool_calls=parallel)
    return tag.model_dump(mode="json")
