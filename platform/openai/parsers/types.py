"""Plain-data outputs of the tool-call and reasoning parsers (vLLM 0.32's shapes).

The serving layer turns these into the OpenAI wire objects: ``ToolCall`` into
``message.tool_calls[i]``, ``DeltaMessage`` into one streamed ``delta``.
"""

from __future__ import annotations

import random
import string
import uuid
from dataclasses import dataclass, field
from typing import Any

_MASK_64_BITS = (1 << 64) - 1
_ALPHANUMERIC = string.ascii_letters + string.digits


def make_tool_call_id() -> str:
    """A tool-call id as vLLM makes it: ``chatcmpl-tool-`` and 16 hex digits."""
    return f"chatcmpl-tool-{uuid.uuid4().int & _MASK_64_BITS:016x}"


def make_mistral_tool_call_id() -> str:
    """A Mistral tool-call id: 9 random letters and digits (what mistral-common accepts)."""
    return "".join(random.choices(_ALPHANUMERIC, k=9))


@dataclass
class FunctionCall:
    """A complete call: ``arguments`` is a JSON text (as OpenAI sends it)."""

    name: str
    arguments: str


@dataclass
class ToolCall:
    """One entry of a non-streamed ``message.tool_calls``."""

    function: FunctionCall
    id: str = field(default_factory=make_tool_call_id)
    type: str = "function"

    def to_openai(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": self.type,
            "function": {"name": self.function.name, "arguments": self.function.arguments},
        }


@dataclass
class ExtractedToolCalls:
    """What a tool parser found in a complete model output.

    ``parse_failed`` is loramux's addition: the text looked like a call (the parser's
    marker was there) but no call could be parsed from it, so it is served as content;
    the caller counts it as a parser failure.
    """

    tools_called: bool
    tool_calls: list[ToolCall]
    content: str | None = None
    parse_failed: bool = False


@dataclass
class DeltaFunctionCall:
    """The function part of a streamed tool-call chunk; ``None`` fields are left out."""

    name: str | None = None
    arguments: str | None = None


@dataclass
class DeltaToolCall:
    """One streamed ``delta.tool_calls[i]``: ``id``, ``type`` and ``function.name``
    come once, in the call's first chunk; later chunks carry argument fragments."""

    index: int
    id: str | None = None
    type: str | None = None
    function: DeltaFunctionCall | None = None

    def to_openai(self) -> dict[str, Any]:
        out: dict[str, Any] = {"index": self.index}
        if self.id is not None:
            out["id"] = self.id
        if self.type is not None:
            out["type"] = self.type
        if self.function is not None:
            fn: dict[str, Any] = {}
            if self.function.name is not None:
                fn["name"] = self.function.name
            if self.function.arguments is not None:
                fn["arguments"] = self.function.arguments
            out["function"] = fn
        return out


@dataclass
class DeltaMessage:
    """One streamed ``delta``: any of reasoning text, content text and tool-call chunks."""

    content: str | None = None
    reasoning: str | None = None
    tool_calls: list[DeltaToolCall] = field(default_factory=list)

    def to_openai(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.content is not None:
            out["content"] = self.content
        if self.reasoning is not None:
            out["reasoning"] = self.reasoning
        if self.tool_calls:
            out["tool_calls"] = [call.to_openai() for call in self.tool_calls]
        return out
