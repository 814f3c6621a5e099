"""``qwen3``: Qwen3's ``<think>...</think>`` (vLLM 0.32's ``Qwen3ParserReasoningAdapter``).

The output is a thought from its first character (Qwen3's template may already have
opened ``<think>`` in the prompt) until ``</think>``; a ``<think>`` inside the thought is
dropped, as is a ``</think>`` after it. A ``<tool_call>`` inside the thought also ends
it, and stays in the answer for the tool parser. With ``chat_template_kwargs=
{"enable_thinking": False}`` there is no thought: all of it is the answer.

The markers are matched as text, so a tokenizer without ``<think>`` tokens is
accepted (token ids, where the vocabulary has them, serve ``is_reasoning_end``).
Streamed, a possible half marker is held back, and whitespace-only answer text is
held until real text follows (both sent by :meth:`finish_streaming` at the end).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from loramux.platform.openai.parsers.reasoning_parser import THINK_END, THINK_START, ReasoningParser
from loramux.platform.openai.parsers.text import longest_tag_overlap
from loramux.platform.openai.parsers.types import DeltaMessage

TOOL_CALL_START = "<tool_call>"
TURN_BOUNDARIES = ("<|im_start|>", "<|im_end|>")
_MARKERS = (THINK_START, THINK_END, TOOL_CALL_START)


def split_thought(text: str, thinking: bool = True) -> tuple[str, str, bool]:
    """``(thought, answer, ended)`` of ``text`` by the grammar above."""
    if not thinking:
        return "", text.replace(THINK_END, ""), True
    end = text.find(THINK_END)
    tool = text.find(TOOL_CALL_START)
    if tool != -1 and (end == -1 or tool < end):
        thought, answer = text[:tool], text[tool:]
    elif end != -1:
        thought, answer = text[:end], text[end + len(THINK_END) :]
    else:
        return text.replace(THINK_START, ""), "", False
    return thought.replace(THINK_START, ""), answer.replace(THINK_END, ""), True


class Qwen3ReasoningParser(ReasoningParser):
    start_token = THINK_START
    end_token = THINK_END
    engine_based_streaming = True
    keep_special_tokens = True

    def __init__(self, tokenizer: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(tokenizer, *args, **kwargs)
        chat_kwargs = kwargs.get("chat_template_kwargs") or {}
        self.thinking_enabled = bool(chat_kwargs.get("enable_thinking", True))
        self.start_token_id = self.vocab.get(THINK_START)
        self.end_token_id = self.vocab.get(THINK_END)
        tool_id = self.vocab.get(TOOL_CALL_START)
        # vLLM derives these only when </think> is one token
        self.reasoning_end_token_ids = (
            frozenset(i for i in (self.end_token_id, tool_id) if i is not None)
            if self.end_token_id is not None
            else frozenset()
        )
        self.turn_boundary_ids = frozenset(
            i for t in TURN_BOUNDARIES if (i := self.vocab.get(t)) is not None
        )
        self._sent_thought = 0
        self._sent_answer = 0
        self._ended = not self.thinking_enabled
        self._answer_has_text = False
        self._pending_ws = ""
        self._last_text = ""

    def is_reasoning_end(self, input_ids: Sequence[int]) -> bool:
        for token_id in reversed(input_ids):
            if token_id in self.reasoning_end_token_ids:
                return True
            if token_id == self.start_token_id:
                return False
            if token_id in self.turn_boundary_ids:
                break
        return not self.thinking_enabled

    def extract_content_ids(self, input_ids: list[int]) -> list[int]:
        if not self.thinking_enabled:
            return input_ids
        if self.end_token_id is not None:
            for i in range(len(input_ids) - 1, -1, -1):
                if input_ids[i] == self.end_token_id:
                    return input_ids[i + 1 :]
        if self.reasoning_end_token_ids:
            turn_start = 0
            for i in range(len(input_ids) - 1, -1, -1):
                if input_ids[i] in self.turn_boundary_ids:
                    turn_start = i + 1
                    break
            for i in range(turn_start, len(input_ids)):
                if input_ids[i] in self.reasoning_end_token_ids:
                    return input_ids[i:]
        return input_ids

    def extract_reasoning(self, model_output: str, request: Any) -> tuple[str | None, str | None]:
        if not self.thinking_enabled:
            return None, model_output
        thought, answer, _ = split_thought(model_output)
        return thought or None, answer or None

    def reasoning_ended(self) -> bool:
        return self._ended

    def extract_reasoning_streaming(
        self,
        previous_text: str,
        current_text: str,
        delta_text: str,
        previous_token_ids: Sequence[int],
        current_token_ids: Sequence[int],
        delta_token_ids: Sequence[int],
    ) -> DeltaMessage | None:
        self._last_text = current_text
        held = longest_tag_overlap(current_text, _MARKERS)
        return self._step(current_text[: len(current_text) - held], final=False)

    def finish_streaming(self) -> DeltaMessage | None:
        return self._step(self._last_text, final=True)

    def _step(self, text: str, final: bool) -> DeltaMessage | None:
        thought, answer, ended = split_thought(text, self.thinking_enabled)
        self._ended = self._ended or ended
        reasoning = thought[self._sent_thought :] or None
        self._sent_thought = max(self._sent_thought, len(thought))
        content = answer[self._sent_answer :]
        self._sent_answer = max(self._sent_answer, len(answer))
        if content and not self._answer_has_text:
            if content.strip():
                self._answer_has_text = True
                content, self._pending_ws = self._pending_ws + content, ""
            else:
                self._pending_ws += content
                content = ""
        if final and self._pending_ws:
            content, self._pending_ws = content + self._pending_ws, ""
        if reasoning or content:
            return DeltaMessage(reasoning=reasoning, content=content or None)
        return None

    def count_reasoning_tokens(self, token_ids: Sequence[int]) -> int:
        """Tokens of the thought, its markers not counted."""
        if not self.thinking_enabled or not token_ids:
            return 0
        ids = list(token_ids)
        if self.end_token_id is not None and self.end_token_id in ids:
            markers = {self.start_token_id, self.end_token_id}
            return sum(1 for i in ids[: ids.index(self.end_token_id)] if i not in markers)
        return self._count_by_text(ids)

    def _count_by_text(self, ids: list[int]) -> int:
        """Without a ``</think>`` token: the tokens whose text lies inside the thought,
        found by decoding prefixes (binary search, a few decodes)."""
        text = self.model_tokenizer.decode(ids)
        ends = [i for i in (text.find(THINK_END), text.find(TOOL_CALL_START)) if i != -1]
        thought_end = min(ends) if ends else len(text)

        def decoded_len(n: int) -> int:
            return len(self.model_tokenizer.decode(ids[:n]))

        def last_prefix_within(limit: int) -> int:
            lo, hi = 0, len(ids)
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if decoded_len(mid) <= limit:
                    lo = mid
                else:
                    hi = mid - 1
            return lo

        inside = last_prefix_within(thought_end)
        opened = last_prefix_within(len(THINK_START)) if text.startswith(THINK_START) else 0
        return max(0, inside - opened)
