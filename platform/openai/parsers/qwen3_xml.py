"""``qwen3_xml`` (also ``qwen3_coder``): Qwen3-Coder / Qwen3.5 XML tool calls (vLLM 0.32's
``Qwen3EngineToolParser``). The format and grammar are in :mod:`.qwen3_xml_scan`; the
markers are matched as text, so any tokenizer is accepted.

- Non-streamed: each call's name is the text of ``<function=NAME>`` (stripped; a call
  without a name is dropped), its arguments the parameters as a JSON object, values
  re-typed by the request tool's ``parameters`` schema when it has one (strings
  otherwise). Content is the text before the first call, stripped when there are
  calls; text after the calls is dropped, as vLLM does. A ``<tool_call>`` that
  yields no call sets ``parse_failed``.
- Streamed: content streams as it comes (whitespace-only content held until real
  text follows and dropped once a call started, as vLLM's engine does; unlike the
  non-streamed answer, text after a call is sent). A call sends id, type and name
  when its first argument text arrives, then the stable prefix of its arguments
  JSON, and the rest when ``</function>`` (or the end) closes it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from loramux.platform.openai.parsers.qwen3_xml_scan import (
    FUNC_PREFIX,
    HELD_MARKERS,
    TOOL_START,
    Scan,
    ToolSlot,
    arguments_json,
    safe_arguments_prefix,
    scan,
)
from loramux.platform.openai.parsers.text import longest_tag_overlap
from loramux.platform.openai.parsers.tool_parser import ToolParser
from loramux.platform.openai.parsers.tools import (
    calls_suppressed,
    find_tool_properties,
    fix_argument_types,
    streamable_string_keys,
)
from loramux.platform.openai.parsers.types import (
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    ExtractedToolCalls,
    FunctionCall,
    ToolCall,
    make_tool_call_id,
)

_NAME_IN_JSON = ("name",)


class Qwen3XmlToolParser(ToolParser):
    keep_special_tokens = True
    structural_tag_model = "qwen_3_coder"
    supports_required_and_named = False  # structural tags constrain it (vLLM's default)

    def __init__(self, tokenizer: Any, tools: list[Any] | None = None) -> None:
        super().__init__(tokenizer, tools)
        self._content_sent = 0  # characters of scan content already handled
        self._content_has_text = False
        self._pending_ws = ""
        self._ids: list[str] = []
        self._names_sent: list[bool] = []
        self._last_text = ""
        self._request: Any = None

    def extract_tool_calls(self, model_output: str, request: Any) -> ExtractedToolCalls:
        result = scan(model_output)
        if calls_suppressed(request):
            return ExtractedToolCalls(
                False, [], result.content_before + result.content_after or None
            )
        tools = self.request_tools(request)
        calls: list[ToolCall] = []
        for slot in result.slots:
            if not slot.name and not slot.args:
                continue
            name = slot.name.strip()
            if not name and slot.args.strip():
                name, args = _name_and_args_from_json(slot.args)
            elif slot.args.strip():
                args = arguments_json(slot.args, partial=False)
            else:
                args = "{}"
            if name:
                args = fix_argument_types(args, name, tools)
                calls.append(ToolCall(function=FunctionCall(name=name, arguments=args)))
        if calls:
            content = result.content_before.strip()
        else:
            content = result.content_before + result.content_after
        looked_like_call = TOOL_START in model_output or FUNC_PREFIX in model_output
        return ExtractedToolCalls(
            bool(calls), calls, content or None, parse_failed=looked_like_call and not calls
        )

    # -- streamed ---------------------------------------------------------------------

    def extract_tool_calls_streaming(
        self,
        previous_text: str,
        current_text: str,
        delta_text: str,
        previous_token_ids: Sequence[int],
        current_token_ids: Sequence[int],
        delta_token_ids: Sequence[int],
        request: Any,
    ) -> DeltaMessage | None:
        self._last_text = current_text
        self._request = request
        visible = current_text[
            : len(current_text) - longest_tag_overlap(current_text, HELD_MARKERS)
        ]
        return self._step(scan(visible), final=False)

    def finish_streaming(self) -> DeltaMessage | None:
        delta = self._step(scan(self._last_text), final=True)
        if self._pending_ws and not self._ids:
            delta = delta or DeltaMessage()
            delta.content = (delta.content or "") + self._pending_ws
        self._pending_ws = ""
        return delta

    def _content(self, result: Scan) -> str | None:
        text = result.content_before + result.content_after
        new = text[self._content_sent :]
        self._content_sent = len(text)
        if not new:
            return None
        if self._content_has_text:
            return new
        if new.strip():
            self._content_has_text = True
            new, self._pending_ws = self._pending_ws + new, ""
            return new
        if result.slots:
            self._pending_ws = ""
            return None
        self._pending_ws += new
        return None

    def _step(self, result: Scan, final: bool) -> DeltaMessage | None:
        content = self._content(result)
        if result.slots and not self._content_has_text:
            self._pending_ws = ""
        tools = self.request_tools(self._request)
        deltas: list[DeltaToolCall] = []
        slots = [] if calls_suppressed(self._request) else result.slots
        for index, slot in enumerate(slots):
            while len(self._ids) <= index:
                self._ids.append("")
                self._names_sent.append(False)
                self.streamed_args_for_tool.append("")
                self.prev_tool_call_arr.append({})
            closed = slot.ended or final
            delta = self._slot_delta(index, slot, closed, tools)
            if delta is not None:
                deltas.append(delta)
        if content or deltas:
            return DeltaMessage(content=content, tool_calls=deltas)
        return None

    def _slot_delta(
        self, index: int, slot: ToolSlot, closed: bool, tools: list[Any]
    ) -> DeltaToolCall | None:
        sent = self.streamed_args_for_tool[index]
        name_chunk: DeltaToolCall | None = None
        if not self._names_sent[index]:
            if not slot.name or (not slot.args and not closed):
                return None
            self._names_sent[index] = True
            self._ids[index] = make_tool_call_id()
            self.prev_tool_call_arr[index] = {"name": slot.name}
            name_chunk = DeltaToolCall(
                index=index,
                id=self._ids[index],
                type="function",
                function=DeltaFunctionCall(name=slot.name),
            )
        name = self.prev_tool_call_arr[index]["name"]
        if closed:
            target = fix_argument_types(arguments_json(slot.args, partial=False), name, tools)
        else:
            partial = fix_argument_types(arguments_json(slot.args, partial=True), name, tools)
            keys = streamable_string_keys(find_tool_properties(tools, name))
            target = safe_arguments_prefix(partial, keys)
        diff = ""
        if len(target) > len(sent) and target.startswith(sent):
            diff = target[len(sent) :]
            self.streamed_args_for_tool[index] = target
            self.prev_tool_call_arr[index]["arguments"] = target
        if name_chunk is not None:
            if diff or closed:
                name_chunk.function.arguments = diff  # type: ignore[union-attr]
            return name_chunk
        if diff:
            return DeltaToolCall(index=index, function=DeltaFunctionCall(arguments=diff))
        return None


def _name_and_args_from_json(raw: str) -> tuple[str, str]:
    """A body without ``<function=NAME>``: vLLM reads ``{"name", "arguments"}`` JSON."""
    try:
        parsed = json.loads(raw.strip())
    except json.JSONDecodeError:
        return "", raw.strip()
    if not isinstance(parsed, dict):
        return "", raw.strip()
    name = parsed.get("name", "")
    for key in ("arguments", "parameters"):
        if key in parsed:
            value = parsed[key]
            return name, value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    rest = {k: v for k, v in parsed.items() if k not in _NAME_IN_JSON}
    return name, json.dumps(rest, ensure_ascii=False)
