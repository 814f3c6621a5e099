"""Helpers of the parser tests: a request double, and stream replays that feed a
parser the way the serving layer does (token by token, or in character chunks) and
rebuild what an OpenAI client would."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from loramux.platform.openai.parsers import DeltaMessage


@dataclass
class Request:
    """The two request fields the parsers read."""

    tools: list[dict] | None = None
    tool_choice: Any = "auto"


def function_tool(name: str, properties: dict | None = None) -> dict:
    return {
        "type": "function",
        "function": {
            "name": name,
            "parameters": {"type": "object", "properties": properties or {}},
        },
    }


@dataclass
class StreamedCall:
    index: int
    id: str | None = None
    type: str | None = None
    name: str | None = None
    arguments: str = ""
    id_chunks: int = 0
    name_chunks: int = 0


@dataclass
class Replay:
    """What the client rebuilds from the streamed deltas."""

    content: str = ""
    reasoning: str = ""
    calls: dict[int, StreamedCall] = field(default_factory=dict)
    deltas: list[DeltaMessage] = field(default_factory=list)

    def add(self, delta: DeltaMessage | None) -> None:
        if delta is None:
            return
        self.deltas.append(delta)
        self.content += delta.content or ""
        self.reasoning += delta.reasoning or ""
        for chunk in delta.tool_calls:
            call = self.calls.setdefault(chunk.index, StreamedCall(chunk.index))
            if chunk.id is not None:
                call.id = chunk.id
                call.id_chunks += 1
                call.type = chunk.type
            if chunk.function is not None:
                if chunk.function.name is not None:
                    call.name = chunk.function.name
                    call.name_chunks += 1
                call.arguments += chunk.function.arguments or ""

    def assert_openai_shape(self) -> None:
        """id, type and name once per call, in its first chunk; indexes from 0."""
        assert sorted(self.calls) == list(range(len(self.calls)))
        for call in self.calls.values():
            assert call.id_chunks == 1 and call.name_chunks == 1, call
            assert call.type == "function"
        for delta in self.deltas:
            json.dumps(delta.to_openai())


def _token_steps(tokenizer, text: str) -> list[tuple[str, list[int]]]:
    """``(delta_text, delta_ids)`` per generated token, like an incremental
    detokenizer (a step that ends inside a UTF-8 character waits for the next)."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids, skip_special_tokens=False) == text
    steps: list[tuple[str, list[int]]] = []
    sent = ""
    pending: list[int] = []
    for i, token_id in enumerate(ids):
        pending.append(token_id)
        current = tokenizer.decode(ids[: i + 1], skip_special_tokens=False)
        if current.endswith("\ufffd") or not current.startswith(sent):
            continue
        steps.append((current[len(sent) :], pending))
        sent, pending = current, []
    assert sent == text
    return steps


def _chunk_steps(text: str, size: int) -> list[tuple[str, list[int]]]:
    return [(text[i : i + size], []) for i in range(0, len(text), size)]


def _steps(tokenizer, text: str, mode: str) -> list[tuple[str, list[int]]]:
    if mode == "tokens":
        return _token_steps(tokenizer, text)
    return _chunk_steps(text, int(mode.removeprefix("chars")))


STREAM_MODES = ["tokens", "chars1", "chars3", "chars7", f"chars{10**6}"]


def stream_tool_parser(parser, tokenizer, text: str, request: Any, mode: str = "tokens") -> Replay:
    """Feed ``text`` to a tool parser step by step; what the client rebuilds."""
    replay = Replay()
    previous, previous_ids = "", []
    for delta_text, delta_ids in _steps(tokenizer, text, mode):
        current, current_ids = previous + delta_text, previous_ids + delta_ids
        replay.add(
            parser.safe_extract_tool_calls_streaming(
                previous, current, delta_text, previous_ids, current_ids, delta_ids, request
            )
        )
        previous, previous_ids = current, current_ids
    replay.add(parser.safe_finish_streaming())
    replay.assert_openai_shape()
    return replay


def stream_reasoning_parser(parser, tokenizer, text: str, mode: str = "tokens") -> Replay:
    """Feed ``text`` to a reasoning parser step by step; what the client rebuilds."""
    replay = Replay()
    previous, previous_ids = "", []
    for delta_text, delta_ids in _steps(tokenizer, text, mode):
        current, current_ids = previous + delta_text, previous_ids + delta_ids
        replay.add(
            parser.extract_reasoning_streaming(
                previous, current, delta_text, previous_ids, current_ids, delta_ids
            )
        )
        previous, previous_ids = current, current_ids
    replay.add(parser.finish_streaming())
    return replay
