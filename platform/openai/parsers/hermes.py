"""``hermes``: Hermes 2 Pro / Qwen 2.5 / Qwen3 JSON tool calls (vLLM's ``Hermes2ProToolParser``).

Format: ``content<tool_call>{"name": "f", "arguments": {...}}</tool_call>`` repeated for
parallel calls; the closing tag of the last call may be missing. The markers are
matched as text, so a tokenizer without ``<tool_call>`` tokens is accepted.

- Non-streamed: every ``<tool_call>`` body must be JSON with ``name`` and ``arguments``;
  ``arguments`` are re-serialized with ``json.dumps``. Content is the text before the
  first ``<tool_call>`` (``None`` if empty); text between and after calls is dropped.
  Any body that does not parse: the whole text is content and ``parse_failed``.
- Streamed: the text before the first ``<tool_call>`` streams as content (a possible
  partial marker held back); each call sends id, type and name once the name is
  complete, then the raw ``arguments`` text as it grows (the closing ``}`` of the
  outer object withheld).
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Sequence
from typing import Any

from loramux.platform.openai.parsers.text import is_complete_json, partial_tag_overlap
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

_NAME = re.compile(r'"name"\s*:\s*"([^"]+)"')
_ARGUMENTS = re.compile(r'"arguments"\s*:\s*')


class HermesToolParser(ToolParser):
    keep_special_tokens = True
    structural_tag_model = "hermes"
    supports_required_and_named = False  # structural tags constrain it (vLLM's default)

    tool_call_start_token = "<tool_call>"
    tool_call_end_token = "</tool_call>"
    tool_call_regex = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)

    def __init__(self, tokenizer: Any, tools: list[Any] | None = None) -> None:
        super().__init__(tokenizer, tools)
        self._sent_content_idx = 0

    def extract_tool_calls(self, model_output: str, request: Any) -> ExtractedToolCalls:
        if self.tool_call_start_token not in model_output:
            return ExtractedToolCalls(False, [], model_output)
        try:
            bodies = [a or b for a, b in self.tool_call_regex.findall(model_output)]
            calls = []
            for body in bodies:
                parsed = json.loads(body)
                calls.append(
                    ToolCall(
                        function=FunctionCall(
                            name=parsed["name"],
                            arguments=json.dumps(parsed["arguments"], ensure_ascii=False),
                        )
                    )
                )
        except Exception:
            logger.info("hermes: a <tool_call> did not parse; serving it as content")
            return ExtractedToolCalls(False, [], model_output, parse_failed=True)
        content = model_output[: model_output.find(self.tool_call_start_token)]
        return ExtractedToolCalls(True, calls, content or None)

    # -- streaming ------------------------------------------------------------------

    def _unsent_content(self, current_text: str) -> str | None:
        if self.tool_call_start_token in current_text:
            sendable = current_text.index(self.tool_call_start_token)
        else:
            sendable = len(current_text) - partial_tag_overlap(
                current_text, self.tool_call_start_token
            )
        if sendable > self._sent_content_idx:
            content = current_text[self._sent_content_idx : sendable]
            self._sent_content_idx = sendable
            return content
        return None

    def _call_bodies(self, text: str) -> list[tuple[str, bool]]:
        """``(json_text, complete)`` for every ``<tool_call>`` region so far."""
        bodies: list[tuple[str, bool]] = []
        pos = 0
        while (start := text.find(self.tool_call_start_token, pos)) != -1:
            body_start = start + len(self.tool_call_start_token)
            end = text.find(self.tool_call_end_token, body_start)
            if end != -1:
                bodies.append((text[body_start:end].strip(), True))
                pos = end + len(self.tool_call_end_token)
                continue
            raw = text[body_start:]
            overlap = partial_tag_overlap(raw, self.tool_call_end_token)
            if overlap:
                raw = raw[:-overlap]
            body = raw.strip()
            bodies.append((body, is_complete_json(body) if body else False))
            break
        return bodies

    @staticmethod
    def _arguments_text(body: str, complete: bool) -> str | None:
        match = _ARGUMENTS.search(body)
        if match is None:
            return None
        raw = body[match.end() :]
        if complete:
            raw = raw.rstrip()
            if raw.endswith("}"):
                raw = raw[:-1].rstrip()
        return raw

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
        content = self._unsent_content(current_text)
        deltas: list[DeltaToolCall] = []
        for i, (body, complete) in enumerate(self._call_bodies(current_text)):
            if i >= len(self.prev_tool_call_arr):
                self.prev_tool_call_arr.append({})
                self.streamed_args_for_tool.append("")
            if "name" not in self.prev_tool_call_arr[i]:
                match = _NAME.search(body)
                if match is None:
                    break
                self.prev_tool_call_arr[i]["name"] = match.group(1)
                deltas.append(
                    DeltaToolCall(
                        index=i,
                        id=make_tool_call_id(),
                        type="function",
                        function=DeltaFunctionCall(name=match.group(1)),
                    )
                )
            args = self._arguments_text(body, complete)
            sent = self.streamed_args_for_tool[i]
            if args is not None and len(args) > len(sent):
                self.streamed_args_for_tool[i] = args
                self.prev_tool_call_arr[i]["arguments"] = args
                deltas.append(
                    DeltaToolCall(index=i, function=DeltaFunctionCall(arguments=args[len(sent) :]))
                )
        if content or deltas:
            return DeltaMessage(content=content, tool_calls=deltas)
        return None
