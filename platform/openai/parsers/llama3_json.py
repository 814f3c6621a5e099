"""``llama3_json`` (and ``llama4_json``): Llama 3.x / 4 JSON tool calls (vLLM's
``Llama3JsonToolParser``).

Format: an optional ``<|python_tag|>`` then ``{"name": "f", "arguments": {...}}``
(``"parameters"`` is accepted for ``"arguments"``), several calls separated by ``; ``.
Start-up refusal: the tokenizer must have the ``<|python_tag|>`` token.

- Non-streamed: every JSON object found in the text (outside earlier objects) must
  have ``name`` and ``arguments``/``parameters``; then all are calls and content is
  ``None`` (surrounding text is dropped, as vLLM does). A missing key or an object
  that does not decode: the whole text is content and ``parse_failed``.
- Streamed: only an answer that starts with ``<|python_tag|>`` or ``{`` is parsed,
  anything else streams as content. Arguments stream as the growing prefix of
  ``json.dumps(arguments)``, so the concatenated fragments equal the non-streamed
  arguments; the last call's tail comes in :meth:`finish_streaming` when needed.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Sequence
from typing import Any

from loramux.platform.openai.parsers.partial_json import MalformedJSON, loads_prefix
from loramux.platform.openai.parsers.text import common_prefix, is_complete_json
from loramux.platform.openai.parsers.tool_parser import ToolParser
from loramux.platform.openai.parsers.types import (
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    ExtractedToolCalls,
    FunctionCall,
    ToolCall,
    make_tool_call_id,
)

logger = logging.getLogger(__name__)

_OPEN_BRACE = re.compile(r"\{")


class Llama3JsonToolParser(ToolParser):
    structural_tag_model = "llama"
    supports_required_and_named = False  # structural tags constrain it (vLLM's default)

    bot_token = "<|python_tag|>"

    def __init__(self, tokenizer: Any, tools: list[Any] | None = None) -> None:
        super().__init__(tokenizer, tools)
        self.bot_token_id = self.vocab.get(self.bot_token)
        if self.bot_token_id is None:
            raise RuntimeError(
                "Llama3JsonToolParser could not locate the bot token "
                f"'{self.bot_token}' in the tokenizer."
            )

    def extract_tool_calls(self, model_output: str, request: Any) -> ExtractedToolCalls:
        if self.bot_token not in model_output and "{" not in model_output:
            return ExtractedToolCalls(False, [], model_output)
        decoder = json.JSONDecoder()
        end_index = -1
        calls: list[ToolCall] = []
        for match in _OPEN_BRACE.finditer(model_output):
            start = match.start()
            if start <= end_index:
                continue
            try:
                obj, length = decoder.raw_decode(model_output[start:])
                end_index = start + length
                name = obj["name"]
                args = obj["arguments"] if "arguments" in obj else obj["parameters"]
                calls.append(
                    ToolCall(
                        function=FunctionCall(
                            name=name, arguments=json.dumps(args, ensure_ascii=False)
                        )
                    )
                )
            except Exception:
                logger.info("llama3_json: a JSON call did not parse; serving it as content")
                return ExtractedToolCalls(False, [], model_output, parse_failed=True)
        if calls:
            return ExtractedToolCalls(True, calls, None)
        return ExtractedToolCalls(False, [], model_output)

    def _parse_calls(self, current_text: str) -> tuple[list[dict], list[bool]]:
        partial_strings = self.current_tool_name_sent
        start = len(self.bot_token) if current_text.startswith(self.bot_token) else 0
        calls: list[dict] = []
        complete: list[bool] = []
        while start < len(current_text):
            obj, length = loads_prefix(current_text[start:], partial_strings)
            complete.append(is_complete_json(current_text[start : start + length]))
            start += length + len("; ")
            if not isinstance(obj, dict):
                raise MalformedJSON("a call is not a JSON object")
            if "parameters" in obj:
                if "arguments" in obj:
                    raise MalformedJSON("model generated both parameters and arguments")
                obj["arguments"] = obj["parameters"]
            calls.append(obj)
        return calls, complete

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
        if not (current_text.startswith(self.bot_token) or current_text.startswith("{")):
            if self.bot_token.startswith(current_text):
                return None  # the marker is arriving in pieces (text, not its token)
            if self.bot_token.startswith(previous_text) and previous_text:
                return DeltaMessage(content=current_text)  # what was held back, too
            return DeltaMessage(content=delta_text)
        try:
            calls, complete = self._parse_calls(current_text)
        except MalformedJSON:
            return None  # not enough text to parse yet
        if not calls:
            return None
        chunks: list[DeltaToolCall] = []
        while True:
            at = self.current_tool_id
            announced = at < 0 or self.current_tool_name_sent or not calls[at].get("name")
            if len(calls) > at + 1 and announced:
                # the next call has started: first send what the current one still lacks
                if self.current_tool_id >= 0:
                    args = calls[self.current_tool_id].get("arguments")
                    if args:
                        args_json = json.dumps(args, ensure_ascii=False)
                        sent = self.streamed_args_for_tool[self.current_tool_id]
                        self._send_args(chunks, self.current_tool_id, args_json[len(sent) :])
                self.current_tool_id += 1
                self.current_tool_name_sent = False
                self.streamed_args_for_tool.append("")
                continue
            current = calls[self.current_tool_id]
            if not self.current_tool_name_sent:
                name = current.get("name")
                if not name:
                    break
                self.current_tool_name_sent = True
                chunks.append(
                    DeltaToolCall(
                        index=self.current_tool_id,
                        id=make_tool_call_id(),
                        type="function",
                        function=DeltaFunctionCall(name=name),
                    )
                )
                continue
            self._stream_arguments(chunks, current, complete[self.current_tool_id])
            break
        self.prev_tool_call_arr = calls
        return DeltaMessage(tool_calls=chunks) if chunks else None

    def _stream_arguments(self, chunks: list[DeltaToolCall], current: dict, complete: bool) -> None:
        """Send the part of the current call's arguments that can no longer change:
        all of it once the call's JSON is complete, else the common prefix of this
        step's and the last step's ``json.dumps(arguments)``."""
        args = current.get("arguments")
        if not args:
            return
        index = self.current_tool_id
        args_json = json.dumps(args, ensure_ascii=False)
        sent = len(self.streamed_args_for_tool[index])
        prev = (
            self.prev_tool_call_arr[index].get("arguments")
            if index < len(self.prev_tool_call_arr)
            else None
        )
        if complete:
            self._send_args(chunks, index, args_json[sent:])
        elif prev:
            prev_json = json.dumps(prev, ensure_ascii=False)
            if args_json != prev_json:
                self._send_args(chunks, index, common_prefix(prev_json, args_json)[sent:])

    def _send_args(self, chunks: list[DeltaToolCall], index: int, diff: str) -> None:
        if not diff:
            return
        self.streamed_args_for_tool[index] += diff
        if chunks and chunks[-1].index == index and chunks[-1].function is not None:
            chunks[-1].function.arguments = (chunks[-1].function.arguments or "") + diff
        else:
            chunks.append(DeltaToolCall(index=index, function=DeltaFunctionCall(arguments=diff)))
