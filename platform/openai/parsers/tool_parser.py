"""The tool-call parser seam (vLLM's ``ToolParser`` interface).

One parser instance serves one request: it is built per request with the served
tokenizer (and the request's tools), then the serving layer calls

- :meth:`ToolParser.extract_tool_calls` once on the whole answer text (non-streamed);
- or, streamed, :meth:`ToolParser.extract_tool_calls_streaming` after every detokenized
  step with the answer text so far, then :meth:`ToolParser.finish_streaming` once when
  generation ends (it sends argument text that was parsed but held back).

The ``safe_*`` wrappers are what the serving layer should call: a parser exception
never escapes them; it is logged, the text is served as content and
:attr:`ToolParser.parse_failed` is set so the caller can count a parser failure.
Constructing a parser may raise: that is its start-up refusal (see
``registry.validate_parser_tokenizer``).
"""

from __future__ import annotations

import json
import logging
from abc import ABC, abstractmethod
from collections.abc import Sequence
from functools import cached_property
from typing import Any, ClassVar

from loramux.platform.openai.parsers.tools import request_tools
from loramux.platform.openai.parsers.types import (
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    ExtractedToolCalls,
)

logger = logging.getLogger(__name__)


class ToolParser(ABC):
    """Base class of every tool-call parser; subclasses register by name with
    ``ToolParserManager.register_module``."""

    #: The output must be detokenized with special tokens kept (``skip_special_tokens
    #: =False``): the parser's markers are special tokens in some vocabularies.
    keep_special_tokens: ClassVar[bool] = False
    #: Whether vLLM's generic JSON handling of ``tool_choice="required"`` / a named
    #: function applies to this format (False: parse those with this parser, as "auto").
    supports_required_and_named: ClassVar[bool] = True
    #: The xgrammar structural-tag model vLLM constrains this format with, if any.
    structural_tag_model: ClassVar[str | None] = None

    def __init__(self, tokenizer: Any, tools: list[Any] | None = None) -> None:
        if tokenizer is None:
            raise ValueError(
                "The model tokenizer must be passed to the ToolParser "
                "constructor during construction."
            )
        self.model_tokenizer = tokenizer
        self.tools: list[Any] = list(tools or [])
        # streaming state, in vLLM's names
        self.prev_tool_call_arr: list[dict] = []
        self.current_tool_id: int = -1
        self.current_tool_name_sent: bool = False
        self.streamed_args_for_tool: list[str] = []
        #: set when the text looked like a call but did not parse (streamed or not)
        self.parse_failed: bool = False
        self._streamed_text = ""
        self._streamed_request: Any = None

    @cached_property
    def vocab(self) -> dict[str, int]:
        """The tokenizer's vocabulary (token text -> id)."""
        return self.model_tokenizer.get_vocab()

    def request_tools(self, request: Any) -> list[Any]:
        """The request's tools, else the ones given at construction."""
        return request_tools(request) or self.tools

    @abstractmethod
    def extract_tool_calls(self, model_output: str, request: Any) -> ExtractedToolCalls:
        """Parse a complete answer. Called once, for a non-streamed response."""

    @abstractmethod
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
        """Parse one streamed step (``current_text == previous_text + delta_text``).

        Returns what to send for this step (content and/or tool-call chunks), or
        ``None`` when nothing is ready yet (e.g. a marker is half generated).
        """

    def finish_streaming(self) -> DeltaMessage | None:
        """Called once when a streamed generation ends: the argument text of the last
        call that was parsed but not yet sent (vLLM's serving layer appends it to the
        final chunk), as one chunk, or ``None``. Never for a call whose name was not
        parsed (vLLM would send arguments of a call it never announced)."""
        remaining = self.remaining_unstreamed_args()
        index = len(self.prev_tool_call_arr) - 1
        if not remaining or not self.prev_tool_call_arr[index].get("name"):
            return None
        self.streamed_args_for_tool[index] += remaining
        return DeltaMessage(
            tool_calls=[DeltaToolCall(index=index, function=DeltaFunctionCall(arguments=remaining))]
        )

    def remaining_unstreamed_args(self) -> str:
        """Arguments of the last call that were parsed but not yet streamed."""
        if not self.prev_tool_call_arr:
            return ""
        index = len(self.prev_tool_call_arr) - 1
        args = self.prev_tool_call_arr[index].get("arguments", {})
        expected = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
        actual = (
            self.streamed_args_for_tool[index] if index < len(self.streamed_args_for_tool) else ""
        )
        if index >= len(self.streamed_args_for_tool) or not expected.startswith(actual):
            return ""
        return expected[len(actual) :]

    # -- the serving layer's entry points ---------------------------------------------

    def safe_extract_tool_calls(self, model_output: str, request: Any) -> ExtractedToolCalls:
        """:meth:`extract_tool_calls` that never raises; a failure is served as content."""
        try:
            result = self.extract_tool_calls(model_output, request)
        except Exception:
            logger.exception("tool parser %s failed; serving the text as content", type(self))
            self.parse_failed = True
            return ExtractedToolCalls(False, [], model_output, parse_failed=True)
        if result.parse_failed:
            self.parse_failed = True
        return result

    def safe_extract_tool_calls_streaming(
        self,
        previous_text: str,
        current_text: str,
        delta_text: str,
        previous_token_ids: Sequence[int],
        current_token_ids: Sequence[int],
        delta_token_ids: Sequence[int],
        request: Any,
    ) -> DeltaMessage | None:
        """:meth:`extract_tool_calls_streaming` that never raises (a failing step sends
        nothing and sets :attr:`parse_failed`)."""
        self._streamed_text, self._streamed_request = current_text, request
        try:
            return self.extract_tool_calls_streaming(
                previous_text,
                current_text,
                delta_text,
                previous_token_ids,
                current_token_ids,
                delta_token_ids,
                request,
            )
        except Exception:
            logger.exception("tool parser %s failed on a streamed step", type(self))
            self.parse_failed = True
            return None

    def safe_finish_streaming(self) -> DeltaMessage | None:
        """:meth:`finish_streaming` that never raises. It also parses the whole streamed
        text once more (``extract_tool_calls`` is stateless) so that a stream whose
        text looked like a call but did not parse sets :attr:`parse_failed` as the
        non-streamed answer would."""
        try:
            delta = self.finish_streaming()
        except Exception:
            logger.exception("tool parser %s failed at the end of a stream", type(self))
            self.parse_failed = True
            delta = None
        if self._streamed_text and not self.parse_failed:
            whole = self.safe_extract_tool_calls(self._streamed_text, self._streamed_request)
            self.parse_failed = whole.parse_failed
        return delta
