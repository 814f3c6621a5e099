"""``mistral``: Mistral tool calls (vLLM's ``MistralToolParser``), in both of its formats.

Start-up refusal: the tokenizer must have the ``[TOOL_CALLS]`` token. Which format is
read follows the vocabulary, as in vLLM:

- v11+ (``[ARGS]`` in the vocabulary): ``content[TOOL_CALLS]name[ARGS]{...}`` (or
  ``[TOOL_CALLS]name{...}``), one ``[TOOL_CALLS]`` per parallel call. The arguments are
  the first JSON value after the name, as the model wrote it (text after it dropped);
  content is the text before the first call, stripped. A call whose arguments are not
  JSON is still returned (vLLM does), with ``parse_failed`` set.
- pre-v11: ``content[TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]`` (or one bare
  object; without the marker when ``tool_choice`` forced a call). Arguments are
  ``json.dumps`` of the decoded value. A body that yields no call: content is that
  body and ``parse_failed``.

Streamed, arguments are the raw text as generated (JSON-equal to the non-streamed
ones). Ids are 9 random letters and digits, as mistral-common requires.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from loramux.platform.openai.parsers.mistral_legacy import (
    decode_first_json,
    legacy_function_calls,
    scan_call_array,
)
from loramux.platform.openai.parsers.text import is_complete_json, longest_tag_overlap
from loramux.platform.openai.parsers.tool_parser import ToolParser
from loramux.platform.openai.parsers.tools import calls_suppressed, fix_argument_types
from loramux.platform.openai.parsers.types import (
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    ExtractedToolCalls,
    FunctionCall,
    ToolCall,
    make_mistral_tool_call_id,
)
from loramux.platform.openai.parsers.v11_calls import ARGS, first_json_value, split_v11_call

logger = logging.getLogger(__name__)

TOOL_CALLS = "[TOOL_CALLS]"


def _forces_a_call(request: Any) -> bool:
    choice = getattr(request, "tool_choice", None) if request is not None else None
    return choice == "required" or isinstance(choice, dict) or hasattr(choice, "function")


class MistralToolParser(ToolParser):
    keep_special_tokens = True
    supports_required_and_named = False  # the [TOOL_CALLS] format is parsed as "auto"

    bot_token = TOOL_CALLS

    def __init__(self, tokenizer: Any, tools: list[Any] | None = None) -> None:
        super().__init__(tokenizer, tools)
        self.bot_token_id = self.vocab.get(TOOL_CALLS)
        if self.bot_token_id is None:
            raise RuntimeError(
                "Mistral parser could not locate the tool call token in the tokenizer!"
            )
        self.is_pre_v11 = ARGS not in self.vocab
        self._sent_content = 0
        self._pending_ws = ""
        self._content_has_text = False
        self._ids: list[str] = []
        self._names_sent: list[bool] = []
        self._started = False
        self._last_text = ""
        self._body_offset: int | None = None
        self._sent_after: int | None = None
        self._suppressed = False

    # -- non-streamed -----------------------------------------------------------------

    def extract_tool_calls(self, model_output: str, request: Any) -> ExtractedToolCalls:
        if self.is_pre_v11:
            return self._extract_pre_v11(model_output, request)
        if TOOL_CALLS not in model_output:
            return ExtractedToolCalls(False, [], model_output)
        content, *segments = model_output.split(TOOL_CALLS)
        if calls_suppressed(request):
            return ExtractedToolCalls(False, [], content or None)
        tools = self.request_tools(request)
        calls: list[ToolCall] = []
        failed = False
        for segment in segments:
            if not segment:
                continue
            name, raw_args = split_v11_call(segment, closed=True)
            args = first_json_value(raw_args)
            if not is_complete_json(args):
                failed = True
            calls.append(
                ToolCall(
                    id=make_mistral_tool_call_id(),
                    function=FunctionCall(
                        name=name.strip(), arguments=fix_argument_types(args, name.strip(), tools)
                    ),
                )
            )
        content = content.strip() if calls else content
        return ExtractedToolCalls(bool(calls), calls, content or None, failed or not calls)

    def _extract_pre_v11(self, model_output: str, request: Any) -> ExtractedToolCalls:
        if getattr(request, "tool_choice", None) == "none" and self.request_tools(request):
            return ExtractedToolCalls(False, [], model_output)
        content: str | None = None
        if TOOL_CALLS in model_output:
            content, *segments = model_output.split(TOOL_CALLS)
            body = next((s.strip() for s in segments if s.strip()), "")
        elif _forces_a_call(request):
            body = model_output.strip()
        else:
            return ExtractedToolCalls(False, [], model_output)
        functions = legacy_function_calls(decode_first_json(body))
        if not functions:
            logger.info("mistral: no call in the text after [TOOL_CALLS]; serving it as content")
            return ExtractedToolCalls(False, [], body, parse_failed=True)
        calls = [ToolCall(id=make_mistral_tool_call_id(), function=f) for f in functions]
        return ExtractedToolCalls(True, calls, content if content and content.strip() else None)

    # -- streamed ---------------------------------------------------------------------

    def _call_id(self, index: int) -> str:
        while len(self._ids) <= index:
            self._ids.append(make_mistral_tool_call_id())
            self._names_sent.append(False)
            self.streamed_args_for_tool.append("")
            self.prev_tool_call_arr.append({})
        return self._ids[index]

    def _content_delta(self, text: str) -> str | None:
        """Content the way vLLM's engine sends it: whitespace-only content is held
        until real text follows, and dropped once a call starts."""
        if not text:
            return None
        if self._content_has_text:
            return text
        if text.strip():
            self._content_has_text = True
            text, self._pending_ws = self._pending_ws + text, ""
            return text
        self._pending_ws += text
        return None

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
        if self.is_pre_v11:
            return self._stream_pre_v11(current_text, request, final=False)
        self._suppressed = calls_suppressed(request)
        return self._stream_v11(current_text, final=False)

    def finish_streaming(self) -> DeltaMessage | None:
        text = self._last_text
        if self.is_pre_v11:
            delta = self._stream_pre_v11(text, None, final=True)
        else:
            delta = self._stream_v11(text, final=True)
        if self._pending_ws and not self._ids:
            delta = delta or DeltaMessage()
            delta.content = (delta.content or "") + self._pending_ws
        self._pending_ws = ""
        return delta

    def _stream_v11(self, current_text: str, final: bool) -> DeltaMessage | None:
        self._last_text = current_text
        visible = current_text
        if not final:
            visible = current_text[
                : len(current_text) - longest_tag_overlap(current_text, (TOOL_CALLS, ARGS))
            ]
        content_part, *segments = visible.split(TOOL_CALLS)
        content = None
        if len(content_part) > self._sent_content:
            content = self._content_delta(content_part[self._sent_content :])
            self._sent_content = len(content_part)
        if segments:
            self._pending_ws = ""
        deltas: list[DeltaToolCall] = []
        for index, segment in enumerate([] if self._suppressed else segments):
            closed = final or index < len(segments) - 1
            if not segment and not closed:
                break
            name, raw_args = split_v11_call(segment, closed=closed)
            if raw_args is None:
                break  # the name is still being generated
            if not segment:
                continue
            call_id = self._call_id(index)
            sent = self.streamed_args_for_tool[index]
            if not self._names_sent[index]:
                if not raw_args and not closed:
                    break
                self._names_sent[index] = True
                self.prev_tool_call_arr[index] = {"name": name, "arguments": raw_args}
                self.streamed_args_for_tool[index] = raw_args
                deltas.append(
                    DeltaToolCall(
                        index=index,
                        id=call_id,
                        type="function",
                        function=DeltaFunctionCall(name=name, arguments=raw_args),
                    )
                )
            elif len(raw_args) > len(sent):
                self.streamed_args_for_tool[index] = raw_args
                self.prev_tool_call_arr[index]["arguments"] = raw_args
                deltas.append(
                    DeltaToolCall(
                        index=index, function=DeltaFunctionCall(arguments=raw_args[len(sent) :])
                    )
                )
        if content or deltas:
            return DeltaMessage(content=content, tool_calls=deltas)
        return None

    def _stream_pre_v11(self, current_text: str, request: Any, final: bool) -> DeltaMessage | None:
        self._last_text = current_text
        if not self._started:
            if TOOL_CALLS in current_text:
                self._started = True
            elif request is not None and current_text and _forces_a_call(request):
                self._started = True
                self._sent_content = 0
                self._body_offset = 0
        if not self._started:
            visible = current_text
            if not final:
                visible = current_text[
                    : len(current_text) - longest_tag_overlap(current_text, (TOOL_CALLS,))
                ]
            content = visible[self._sent_content :] or None
            self._sent_content = max(self._sent_content, len(visible))
            return DeltaMessage(content=content) if content else None

        content_parts: list[str] = []
        if self._body_offset is None:
            before = current_text.index(TOOL_CALLS)
            if before > self._sent_content:
                content_parts.append(current_text[self._sent_content : before])
            self._body_offset = before + len(TOOL_CALLS)
        body = current_text[self._body_offset :]
        scan = scan_call_array(body)
        deltas: list[DeltaToolCall] = []
        for index, span in enumerate(scan.calls):
            if span.name is None:
                break
            call_id = self._call_id(index)
            args = ""
            if span.args_start is not None:
                end = span.args_end if span.args_end is not None else len(body)
                if span.args_is_string:  # a string value is sent whole, decoded
                    value = (
                        decode_first_json(body[span.args_start : end]) if span.args_end else None
                    )
                    args = value if isinstance(value, str) else ""
                else:
                    args = body[span.args_start : end]
            sent = self.streamed_args_for_tool[index]
            if not self._names_sent[index]:
                self._names_sent[index] = True
                self.prev_tool_call_arr[index] = {"name": span.name, "arguments": args}
                self.streamed_args_for_tool[index] = args
                deltas.append(
                    DeltaToolCall(
                        index=index,
                        id=call_id,
                        type="function",
                        function=DeltaFunctionCall(name=span.name, arguments=args or None),
                    )
                )
            elif len(args) > len(sent) and args.startswith(sent):
                self.streamed_args_for_tool[index] = args
                self.prev_tool_call_arr[index]["arguments"] = args
                deltas.append(
                    DeltaToolCall(
                        index=index, function=DeltaFunctionCall(arguments=args[len(sent) :])
                    )
                )
        if scan.end is not None:
            after_start = self._body_offset + scan.end
            sent_after = self._sent_after if self._sent_after is not None else after_start
            if len(current_text) > sent_after:
                content_parts.append(current_text[sent_after:])
            self._sent_after = len(current_text)
        content = "".join(content_parts) or None
        if content or deltas:
            return DeltaMessage(content=content, tool_calls=deltas)
        return None
