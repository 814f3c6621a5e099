"""``olmo3``: Olmo 3's ``<think>...</think>`` written as plain text (vLLM's
``Olmo3ReasoningParser``).

The markers are ordinary vocabulary text (``</think>`` is the tokens ``</``/``Ġ</``,
``think``, ``>``). Start-up refusal: those pieces must be in the vocabulary (a
byte-level BPE one). Non-streamed: an output of the form ``[<think>]thought</think>
answer`` is split; anything else is all answer. Streamed: text is buffered while it
may be part of a marker, and sent as thought or answer as the markers pass.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from loramux.platform.openai.parsers.reasoning_parser import THINK_END, THINK_START, ReasoningParser
from loramux.platform.openai.parsers.types import DeltaMessage


def _overlap(a: str, b: str) -> int | None:
    """Length of the longest overlap of ``a`` and ``b`` (containment, or a suffix of
    one that starts the other); ``None`` when there is none (vLLM's ``string_overlap``)."""
    short, long_ = (a, b) if len(a) < len(b) else (b, a)
    if short in long_:
        return len(short)
    for i in range(len(short) - 1, 0, -1):
        if short[-i:] == long_[:i]:
            return i
    for i in range(len(short) - 1, 0, -1):
        if long_[-i:] == short[:i]:
            return i
    return None


class _ThinkBuffer:
    """Holds streamed text while it may be part of ``<think>`` or ``</think>``."""

    def __init__(self) -> None:
        self.buffer = ""
        self.in_reasoning = True  # a template may have put <think> in the prompt

    def process(self) -> DeltaMessage | None:
        start = self.buffer.find(THINK_START)
        if start >= 0:
            self.in_reasoning = True
            before, self.buffer = self.buffer[:start], self.buffer[start + len(THINK_START) :]
            if start > 0:
                return DeltaMessage(content=before)
        end = self.buffer.rfind(THINK_END)
        if end >= 0:
            self.in_reasoning = False
            before, self.buffer = self.buffer[:end], self.buffer[end + len(THINK_END) :]
            if end > 0:
                return DeltaMessage(reasoning=before)
        text, self.buffer = self.buffer, ""
        return DeltaMessage(reasoning=text) if self.in_reasoning else DeltaMessage(content=text)

    def add(self, delta_text: str) -> DeltaMessage | None:
        self.buffer += delta_text
        start_overlap = _overlap(delta_text, THINK_START)
        end_overlap = _overlap(delta_text, THINK_END)
        partial_start = start_overlap is not None and start_overlap < len(THINK_START)
        partial_end = end_overlap is not None and end_overlap < len(THINK_END)
        if partial_start and THINK_START in self.buffer and not partial_end:
            return self.process()
        if partial_end and THINK_END in self.buffer:
            return self.process()
        if partial_start or partial_end:
            return None  # wait for the marker to complete
        return self.process()


class Olmo3ReasoningParser(ReasoningParser):
    start_token = THINK_START
    end_token = THINK_END
    think_end_first_split = ("Ġ</", "</")
    think_end_rest_split = ("think", ">")
    _reasoning = re.compile(
        rf"^(?:{THINK_START})?(?P<reasoning>.*?){THINK_END}(?P<content>.*)$", re.DOTALL
    )

    def __init__(self, tokenizer: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(tokenizer, *args, **kwargs)
        self._buffer = _ThinkBuffer()
        missing = [
            t for t in (*self.think_end_first_split, *self.think_end_rest_split)
            if t not in self.vocab
        ]  # fmt: skip
        if missing:
            raise KeyError(f"Olmo3ReasoningParser: tokens {missing} are not in the vocabulary")
        self.think_end_first_token_ids = [self.vocab[t] for t in self.think_end_first_split]
        self.think_end_rest_token_ids = [self.vocab[t] for t in self.think_end_rest_split]

    def is_reasoning_end(self, input_ids: Sequence[int]) -> bool:
        rest = self.think_end_rest_token_ids
        for i in range(len(input_ids) - len(rest), -1, -1):
            if (
                list(input_ids[i + 1 : i + 1 + len(rest)]) == rest
                and input_ids[i] in self.think_end_first_token_ids
            ):
                return True
        return False

    def extract_content_ids(self, input_ids: list[int]) -> list[int]:
        return []  # vLLM: the streamed text parse decides; these ids carry no answer

    def extract_reasoning(self, model_output: str, request: Any) -> tuple[str | None, str | None]:
        match = self._reasoning.match(model_output)
        if match is None:
            return None, model_output
        return match.group("reasoning") or None, match.group("content") or None

    def extract_reasoning_streaming(
        self,
        previous_text: str,
        current_text: str,
        delta_text: str,
        previous_token_ids: Sequence[int],
        current_token_ids: Sequence[int],
        delta_token_ids: Sequence[int],
    ) -> DeltaMessage | None:
        delta = self._buffer.add(delta_text)
        if delta is None and THINK_END in self._buffer.buffer:
            delta = self._buffer.process()
        return delta

    def finish_streaming(self) -> DeltaMessage | None:
        """Text still buffered at the end (vLLM drops it; loramux sends it)."""
        if not self._buffer.buffer:
            return None
        return self._buffer.process()
