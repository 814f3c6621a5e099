"""``pythonic``: Python-list tool calls (Llama 3.2 / 4, ToolACE; vLLM's ``PythonicToolParser``).

Format: the whole answer is ``[get_weather(city='Paris'), get_time(tz="CET")]``:
keyword arguments with Python or JSON literals (``None``/``null``, ``True``/``true``,
lists, dicts, negative numbers). The markers are text, so any tokenizer is accepted.

- Non-streamed: an answer matching the call-list shape is parsed with :mod:`ast`;
  arguments are ``json.dumps`` of the keyword values; content is ``None``. Anything
  else is content; a call-list shape that does not parse is content and
  ``parse_failed``.
- Streamed: an answer that does not start with ``[`` streams as content. Otherwise
  the unfinished list is completed (closing brackets and quotes) and parsed at
  every step; each call sends id, type, name and its first argument text together,
  then argument fragments, the still-open closing characters withheld.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from typing import Any

from loramux.platform.openai.parsers.pythonic_ast import make_valid_python, parse_call_list
from loramux.platform.openai.parsers.tool_parser import ToolParser
from loramux.platform.openai.parsers.types import (
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    ExtractedToolCalls,
    ToolCall,
)

logger = logging.getLogger(__name__)

_TOOL_CALL_LIST = re.compile(
    r"\[([a-zA-Z]+\w*\(([a-zA-Z]+\w*=.*,\s*)*([a-zA-Z]+\w*=.*\s)?\),\s*)*"
    r"([a-zA-Z]+\w*\(([a-zA-Z]+\w*=.*,\s*)*([a-zA-Z]+\w*=.*\s*)?\)\s*)+\]",
    re.DOTALL,
)


class PythonicToolParser(ToolParser):
    def extract_tool_calls(self, model_output: str, request: Any) -> ExtractedToolCalls:
        if _TOOL_CALL_LIST.match(model_output) is None:
            return ExtractedToolCalls(False, [], model_output)
        try:
            calls = parse_call_list(model_output)
        except Exception:
            logger.info("pythonic: a call list did not parse; serving it as content")
            return ExtractedToolCalls(False, [], model_output, parse_failed=True)
        return ExtractedToolCalls(True, calls, None)

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
        if not current_text.startswith("["):
            return DeltaMessage(content=delta_text)
        completed = make_valid_python(current_text)
        if completed is None:
            return None
        valid_text, added = completed
        calls = parse_call_list(valid_text)

        deltas: list[DeltaToolCall] = []
        for index, call in enumerate(calls):
            if index < self.current_tool_id:
                continue
            self.current_tool_id = index
            if len(self.streamed_args_for_tool) == index:
                self.streamed_args_for_tool.append("")
            call_complete = index < len(calls) - 1 or ")]" not in added
            if call_complete:
                self.current_tool_id += 1
            withheld = added[:-2] if not call_complete else ""
            if not call_complete and added[-2] == ")":
                withheld += "}"  # the arguments object's closing brace
            withheld = withheld.replace("'", '"')  # Python quotes became JSON quotes
            delta = _call_delta(self.streamed_args_for_tool[index], call, index, withheld)
            if delta is not None:
                deltas.append(delta)
                if delta.function is not None and delta.function.arguments is not None:
                    self.streamed_args_for_tool[index] += delta.function.arguments

        # vLLM marks "a call was made" this way so the stream ends with tool_calls
        if deltas and not self.prev_tool_call_arr:
            self.prev_tool_call_arr = [{"arguments": {}}]
        if deltas:
            return DeltaMessage(tool_calls=deltas)
        if not added and self.current_tool_id > 0:
            return DeltaMessage(content="")  # the list is closed: let the stream finish
        return None


def _call_delta(sent: str, call: ToolCall, index: int, withheld: str) -> DeltaToolCall | None:
    args = call.function.arguments
    if withheld:
        if not args.endswith(withheld):
            raise ValueError(f"arguments {args!r} do not end with the withheld {withheld!r}")
        args = args[: -len(withheld)]
    if not sent:
        return DeltaToolCall(
            index=index,
            id=call.id,
            type="function",
            function=DeltaFunctionCall(name=call.function.name, arguments=args),
        )
    diff = args[len(sent) :]
    return DeltaToolCall(index=index, function=DeltaFunctionCall(arguments=diff)) if diff else None
