"""Reasoning delimited by two vocabulary tokens (vLLM's ``BaseThinkingReasoningParser``).

Start-up refusal: both tokens must be in the tokenizer's vocabulary (they are
matched as token ids while streaming).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from itertools import islice
from typing import Any, ClassVar

from loramux.platform.openai.parsers.reasoning_parser import ReasoningParser
from loramux.platform.openai.parsers.types import DeltaMessage


class ThinkingTokensReasoningParser(ReasoningParser):
    """Subclasses set ``start_token`` and ``end_token``."""

    start_token: ClassVar[str]  # the thought's markers, each one token of the vocabulary
    end_token: ClassVar[str]

    def __init__(self, tokenizer: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(tokenizer, *args, **kwargs)
        if not self.model_tokenizer:
            raise ValueError(
                "The model tokenizer must be passed to the ReasoningParser "
                "constructor during construction."
            )
        start_id = self.vocab.get(self.start_token)
        end_id = self.vocab.get(self.end_token)
        if start_id is None or end_id is None:
            raise RuntimeError(
                f"{type(self).__name__} reasoning parser could not locate "
                "think start/end tokens in the tokenizer!"
            )
        self.start_token_id: int = start_id
        self.end_token_id: int = end_id

    def is_reasoning_end(self, input_ids: Sequence[int]) -> bool:
        for token_id in reversed(input_ids):
            if token_id == self.start_token_id:
                return False
            if token_id == self.end_token_id:
                return True
        return False

    def is_reasoning_end_streaming(
        self, input_ids: Sequence[int], delta_ids: Iterable[int]
    ) -> bool:
        return self.end_token_id in delta_ids

    def extract_content_ids(self, input_ids: list[int]) -> list[int]:
        if self.end_token_id not in islice(input_ids, 0, max(0, len(input_ids) - 1)):
            return []
        return input_ids[input_ids.index(self.end_token_id) + 1 :]

    def extract_reasoning(self, model_output: str, request: Any) -> tuple[str | None, str | None]:
        before, start, after = model_output.partition(self.start_token)
        text = after if start else before
        if self.end_token not in text:
            return text, None  # the model may omit the start token: all of it is thought
        reasoning, _, content = text.partition(self.end_token)
        return reasoning, content or None

    def extract_reasoning_streaming(
        self,
        previous_text: str,
        current_text: str,
        delta_text: str,
        previous_token_ids: Sequence[int],
        current_token_ids: Sequence[int],
        delta_token_ids: Sequence[int],
    ) -> DeltaMessage | None:
        if len(delta_token_ids) == 1 and delta_token_ids[0] in (
            self.start_token_id,
            self.end_token_id,
        ):
            return None
        if self.start_token_id in previous_token_ids:
            if self.end_token_id in delta_token_ids:
                return self._split_at_end(delta_text)
            if self.end_token_id in previous_token_ids:
                return DeltaMessage(content=delta_text)
            return DeltaMessage(reasoning=delta_text)
        if self.start_token_id in delta_token_ids:
            if self.end_token_id in delta_token_ids:
                start = delta_text.find(self.start_token)
                end = delta_text.find(self.end_token)
                content = delta_text[end + len(self.end_token) :]
                return DeltaMessage(
                    reasoning=delta_text[start + len(self.start_token) : end],
                    content=content or None,
                )
            return DeltaMessage(reasoning=delta_text)
        return DeltaMessage(content=delta_text)

    def _split_at_end(self, delta_text: str) -> DeltaMessage:
        end = delta_text.find(self.end_token)
        content = delta_text[end + len(self.end_token) :]
        return DeltaMessage(reasoning=delta_text[:end], content=content or None)

    def count_reasoning_tokens(self, token_ids: Sequence[int]) -> int:
        count = depth = 0
        for token_id in token_ids:
            if token_id == self.start_token_id:
                depth += 1
            elif token_id == self.end_token_id:
                depth = max(0, depth - 1)
            elif depth > 0:
                count += 1
        return count
