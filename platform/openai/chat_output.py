"""A chat completion's text → OpenAI ``message`` / streamed ``delta``s: the thought split
off by the reasoning parser, the answer turned into ``tool_calls`` by the tool plan.

:class:`ChatParsing` is built once per request (``serving.py``); it makes one
:class:`ChoiceStream` per streamed choice, or parses a finished choice at once with
:meth:`ChatParsing.message`. The streamed calls concatenate to the non-streamed ones:
ids, types and names come once, in a call's first chunk, then argument fragments.
Parser failures never raise: the text is served as content and ``parse_failed`` is set
(the per-adapter counter).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from loramux.platform.openai.parsers import (
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    ReasoningParser,
    ToolCall,
    ToolParser,
    make_tool_call_id,
)
from loramux.platform.openai.parsers.types import FunctionCall
from loramux.platform.openai.tool_request import ToolPlan, generic_call, parse_generic

logger = logging.getLogger(__name__)


@dataclass
class ParsedMessage:
    """One finished choice, parsed."""

    content: str | None
    reasoning: str | None = None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    reasoning_tokens: int = 0
    parse_failed: bool = False


class ChatParsing:
    """The parsers of one chat request (its tool plan and reasoning parser)."""

    def __init__(self, plan: ToolPlan, reasoning: type[ReasoningParser] | None, tokenizer: Any,
                 request_kwargs: dict[str, Any] | None = None, *,
                 include_reasoning: bool = True) -> None:
        """``include_reasoning`` False (vLLM's request field): the thought is split off and
        counted but not sent."""
        self.plan = plan
        self.include_reasoning = include_reasoning
        self.reasoning_cls = reasoning
        self.tokenizer = tokenizer
        self.template_kwargs = dict(request_kwargs or {})
        self.request = {**plan.request_view(), "chat_template_kwargs": self.template_kwargs}

    @property
    def active(self) -> bool:
        """Whether the text needs any parsing (else it is plain content)."""
        return self.reasoning_cls is not None or (self.plan.choice != "none" and self.plan.parses)

    @property
    def keep_special_tokens(self) -> bool:
        """Detokenize with special tokens: a parser's markers may be special tokens."""
        tool = self.plan.parser is not None and self.plan.choice != "none" and \
            self.plan.parser.keep_special_tokens
        return tool or bool(self.reasoning_cls and self.reasoning_cls.keep_special_tokens)

    def finish_reason(self, called: bool, reason: str | None) -> str | None:
        """``tool_calls`` when calls were made under auto / required and the answer ended
        by itself (a named choice keeps ``stop``, as OpenAI's does; an answer cut off by
        ``max_tokens`` keeps ``length``)."""
        if called and self.plan.choice in ("auto", "required") and reason == "stop":
            return "tool_calls"
        return reason

    def new_reasoner(self) -> ReasoningParser | None:
        """A reasoning parser for one choice (it sees the request's template kwargs, e.g.
        Qwen3's ``enable_thinking``), or None."""
        if self.reasoning_cls is None:
            return None
        return self.reasoning_cls(self.tokenizer, chat_template_kwargs=self.template_kwargs)

    def _tool_parser(self) -> ToolParser | None:
        if self.plan.parser is None or self.plan.choice == "none":
            return None
        return self.plan.parser(self.tokenizer, self.plan.tools)

    def message(self, text: str, token_ids: Sequence[int]) -> ParsedMessage:
        """Parse a finished choice."""
        reasoner = self.new_reasoner()
        reasoning, content = None, text
        tokens = 0
        if reasoner is not None:
            try:
                reasoning, content = reasoner.extract_reasoning(text, self.request)
                tokens = reasoner.count_reasoning_tokens(token_ids)
            except Exception:
                logger.exception("reasoning parser %s failed; serving the text as content",
                                 self.reasoning_cls)
                reasoning, content = None, text
        out = ParsedMessage(content, reasoning if self.include_reasoning else None,
                            reasoning_tokens=tokens)
        if self.plan.choice == "none" or not self.plan.parses:
            return out
        if self.plan.generic:
            try:
                calls = parse_generic(content or "", self.plan)
            except ValueError:
                out.parse_failed = True
                return out
            out.tool_calls = [ToolCall(FunctionCall(n, a)).to_openai() for n, a in calls]
            out.content = None
            return out
        parser = self._tool_parser()
        assert parser is not None
        info = parser.safe_extract_tool_calls(content or "", self.request)
        out.parse_failed = parser.parse_failed
        if info.tools_called:
            calls = info.tool_calls[:1] if not self.plan.parallel else info.tool_calls
            out.tool_calls = [c.to_openai() for c in calls]
            out.content = info.content or None
        elif info.content:
            out.content = info.content
        return out

    def stream(self) -> ChoiceStream:
        """A new streamed choice."""
        return ChoiceStream(self)


class ChoiceStream:
    """One streamed choice: call :meth:`step` with each cumulative snapshot, then
    :meth:`finish` once; each returns the delta dicts to send (possibly none)."""

    def __init__(self, parsing: ChatParsing) -> None:
        self.parsing = parsing
        self.reasoner = parsing.new_reasoner()
        self.tool_parser = parsing._tool_parser()
        self.text = ""
        self.ids: list[int] = []
        self.answer = ""
        self.answer_ids: list[int] = []
        self.called = False
        self.generic_sent = 0
        self.reasoning_tokens = 0
        self._generic_failed = False

    @property
    def parse_failed(self) -> bool:
        return bool(self.tool_parser is not None and self.tool_parser.parse_failed) or \
            self._generic_failed

    def step(self, text: str, token_ids: Sequence[int]) -> list[dict[str, Any]]:
        delta_text, delta_ids = text[len(self.text):], list(token_ids[len(self.ids):])
        prev_text, prev_ids = self.text, self.ids
        self.text, self.ids = text, list(token_ids)
        if not delta_text and not delta_ids:
            return []
        out: list[DeltaMessage] = []
        answer = delta_text
        if self.reasoner is not None:
            dm = self._reason(prev_text, delta_text, prev_ids, delta_ids)
            answer = (dm.content or "") if dm is not None else ""
            if dm is not None and dm.reasoning and self.parsing.include_reasoning:
                out.append(DeltaMessage(reasoning=dm.reasoning))
        if answer:
            out += self._answer(answer, delta_ids)
        return _merge(out)

    def _reason(self, prev_text: str, delta_text: str, prev_ids: list[int],
                delta_ids: list[int]) -> DeltaMessage | None:
        assert self.reasoner is not None
        try:
            return self.reasoner.extract_reasoning_streaming(
                prev_text, self.text, delta_text, prev_ids, self.ids, delta_ids)
        except Exception:
            logger.exception("reasoning parser %s failed on a streamed step",
                             self.parsing.reasoning_cls)
            return DeltaMessage(content=delta_text)

    def _answer(self, delta: str, delta_ids: list[int]) -> list[DeltaMessage]:
        prev, prev_ids = self.answer, self.answer_ids
        self.answer += delta
        self.answer_ids = prev_ids + delta_ids
        plan = self.parsing.plan
        if self.tool_parser is not None:
            dm = self.tool_parser.safe_extract_tool_calls_streaming(
                prev, self.answer, delta, prev_ids, self.answer_ids, delta_ids,
                self.parsing.request)
            return [self._calls_only(dm)] if dm is not None else []
        if plan.choice == "none" or not plan.generic:
            return [DeltaMessage(content=delta)]
        if plan.choice == "named":
            return [self._named(delta)]
        return self._generic_required(delta)

    def _calls_only(self, dm: DeltaMessage) -> DeltaMessage:
        if not self.parsing.plan.parallel:
            dm.tool_calls = [c for c in dm.tool_calls if c.index == 0]
        if dm.tool_calls:
            self.called = True
        return dm

    def _named(self, delta: str) -> DeltaMessage:
        call = DeltaToolCall(index=0, function=DeltaFunctionCall(arguments=delta))
        if not self.called:
            self.called = True
            call.id, call.type = make_tool_call_id(), "function"
            call.function = DeltaFunctionCall(name=self.parsing.plan.named, arguments=delta)
        return DeltaMessage(tool_calls=[call])

    def _generic_required(self, delta: str) -> list[DeltaMessage]:
        """vLLM's generic JSON list: each call is sent once its object is complete (its
        arguments re-serialized, as in the non-streamed answer)."""
        if "}" not in delta:
            return []
        calls = _complete_items(self.answer)
        out = []
        for name, args in calls[self.generic_sent:]:
            if self.generic_sent >= 1 and not self.parsing.plan.parallel:
                break
            out.append(DeltaMessage(tool_calls=[DeltaToolCall(
                index=self.generic_sent, id=make_tool_call_id(), type="function",
                function=DeltaFunctionCall(name=name, arguments=args))]))
            self.generic_sent += 1
            self.called = True
        return out

    def finish(self) -> list[dict[str, Any]]:
        """What is left when the choice ends (text held back while a marker could start,
        arguments parsed but not sent)."""
        out: list[DeltaMessage] = []
        if self.reasoner is not None:
            try:
                tail = self.reasoner.finish_streaming()
                self.reasoning_tokens = self.reasoner.count_reasoning_tokens(self.ids)
            except Exception:
                logger.exception("reasoning parser %s failed at the end of a stream",
                                 self.parsing.reasoning_cls)
                tail = None
            if tail is not None:
                if tail.reasoning and self.parsing.include_reasoning:
                    out.append(DeltaMessage(reasoning=tail.reasoning))
                if tail.content:
                    out += self._answer(tail.content, [])
        if self.tool_parser is not None:
            dm = self.tool_parser.safe_finish_streaming()
            if dm is not None:
                out.append(self._calls_only(dm))
        elif self.parsing.plan.generic and self.parsing.plan.choice == "required":
            try:
                parse_generic(self.answer, self.parsing.plan)
            except ValueError:
                self._generic_failed = True
        return _merge(out)


def _complete_items(text: str) -> list[tuple[str, str]]:
    """The complete ``{"name", "parameters"}`` objects at the start of a JSON list."""
    decoder = json.JSONDecoder()
    pos = text.find("[")
    if pos < 0:
        return []
    pos += 1
    out = []
    while True:
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
        try:
            item, pos = decoder.raw_decode(text, pos)
        except ValueError:
            return out
        if isinstance(item, dict) and isinstance(item.get("name"), str):
            out.append(generic_call(item))


def _merge(deltas: list[DeltaMessage]) -> list[dict[str, Any]]:
    """Adjacent deltas as the fewest wire deltas (a reasoning and a content delta of one
    step go in one chunk; tool-call chunks keep their order)."""
    out: list[dict[str, Any]] = []
    for dm in deltas:
        wire = dm.to_openai()
        if not wire:
            continue
        if out and not (set(out[-1]) & set(wire)):
            out[-1].update(wire)
        else:
            out.append(wire)
    return out
