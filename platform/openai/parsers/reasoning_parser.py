"""The reasoning parser seam (vLLM's ``ReasoningParser`` interface).

One instance serves one request, built with the served tokenizer. The serving layer
calls :meth:`ReasoningParser.extract_reasoning` on a complete output, or, streamed,
:meth:`ReasoningParser.extract_reasoning_streaming` per step until the reasoning has
ended (:meth:`ReasoningParser.is_reasoning_end_streaming`, or
:meth:`ReasoningParser.reasoning_ended` for parsers whose ``engine_based_streaming``
is set), then :meth:`ReasoningParser.finish_streaming` once; tool-call parsing runs on
the content after that. ``is_reasoning_end`` / ``extract_content_ids`` serve the
structured-output backend (constrain the answer only once the thought is over).
Constructing one may raise: its start-up refusal (the think tokens are not in the
vocabulary, for the parsers that match them as token ids).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from functools import cached_property
from typing import Any, ClassVar

from loramux.platform.openai.parsers.types import DeltaMessage

THINK_START = "<think>"
THINK_END = "</think>"
"""The thought markers of the ``<think>`` formats (DeepSeek-R1, Qwen3, OLMo 3)."""


class ReasoningParser(ABC):
    """Base class of every reasoning parser; subclasses register by name with
    ``ReasoningParserManager.register_module``."""

    #: True when streaming is decided by the parser's own text state (ask
    #: :meth:`reasoning_ended`) rather than by the end token's id in the step.
    engine_based_streaming: ClassVar[bool] = False
    #: The output must be detokenized with special tokens kept.
    keep_special_tokens: ClassVar[bool] = False
    #: The text that opens a thought and the one that closes it (None: the format has none).
    start_token: ClassVar[str | None] = None
    end_token: ClassVar[str | None] = None

    def __init__(self, tokenizer: Any, *args: Any, **kwargs: Any) -> None:
        self.model_tokenizer = tokenizer

    @cached_property
    def vocab(self) -> dict[str, int]:
        """The tokenizer's vocabulary (token text -> id)."""
        return self.model_tokenizer.get_vocab()

    @property
    def reasoning_start_str(self) -> str | None:
        """The text that opens a thought, if the format has one."""
        return self.start_token

    @property
    def reasoning_end_str(self) -> str | None:
        """The text that closes a thought."""
        return self.end_token

    @abstractmethod
    def is_reasoning_end(self, input_ids: Sequence[int]) -> bool:
        """Whether the thought has ended by the end of ``input_ids`` (prompt or output)."""

    def is_reasoning_end_streaming(
        self, input_ids: Sequence[int], delta_ids: Iterable[int]
    ) -> bool:
        """Whether the thought ended in this decode step's ``delta_ids``."""
        return self.is_reasoning_end(input_ids)

    @abstractmethod
    def extract_content_ids(self, input_ids: list[int]) -> list[int]:
        """The token ids of ``input_ids`` that belong to the answer."""

    @abstractmethod
    def extract_reasoning(self, model_output: str, request: Any) -> tuple[str | None, str | None]:
        """``(reasoning, content)`` of a complete output; ``None`` for an empty part."""

    @abstractmethod
    def extract_reasoning_streaming(
        self,
        previous_text: str,
        current_text: str,
        delta_text: str,
        previous_token_ids: Sequence[int],
        current_token_ids: Sequence[int],
        delta_token_ids: Sequence[int],
    ) -> DeltaMessage | None:
        """What this streamed step adds: a delta with ``reasoning`` and/or ``content``,
        or ``None`` when nothing is ready (a marker is half generated)."""

    def reasoning_ended(self) -> bool:
        """For ``engine_based_streaming`` parsers: whether the streamed text so far
        has closed the thought."""
        return False

    def finish_streaming(self) -> DeltaMessage | None:
        """Called once when a stream ends (or the thought ends): text held back while a
        marker might have been starting."""
        return None

    def count_reasoning_tokens(self, token_ids: Sequence[int]) -> int:
        """How many of ``token_ids`` are thought tokens (``usage.completion_tokens_
        details.reasoning_tokens``); 0 where the parser cannot tell."""
        return 0
