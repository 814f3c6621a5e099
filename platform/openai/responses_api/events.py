"""Streamed chat chunks → the Responses API's stream events.

:class:`ResponseEvents` is fed the ``chat.completion.chunk`` objects of one streamed chat
completion (``stream_options.include_usage`` on: the last carries the usage) and returns
the events to send, each with its ``sequence_number``: ``response.created``,
``response.in_progress``, then per output item ``response.output_item.added``, its parts
and deltas (``response.content_part.added``, ``response.output_text.delta`` ... ``.done``,
``response.content_part.done`` for text; ``response.reasoning_text.delta`` / ``.done`` for a
thought; ``response.function_call_arguments.delta`` / ``.done`` for a call) and
``response.output_item.done``; last ``response.completed`` (or ``response.incomplete``)
with the whole response, or, when the chat stream carried an error, ``error`` and
``response.failed``.

One item is open at a time, as OpenAI streams them: a new kind of delta (text after a
thought, a new tool call index) closes the open item first. Deltas of a call already closed
(chat streams never interleave calls) still reach the final response's item.
"""

from __future__ import annotations

import json
from typing import Any

from loramux.platform.openai.responses_api import convert


def sse_event(event: dict[str, Any]) -> str:
    """One event in OpenAI's framing: ``event: <type>`` and ``data: <json>``."""
    data = json.dumps(event, ensure_ascii=False, separators=(",", ":"))
    return f"event: {event['type']}\ndata: {data}\n\n"


class ResponseEvents:
    """The event state of one streamed response (``head``: :func:`convert.response_head`)."""

    def __init__(self, head: dict[str, Any]) -> None:
        self.head = head
        self.items: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None
        self.calls: dict[int, dict[str, Any]] = {}
        self.finish_reason: str | None = None
        self.usage: dict[str, Any] | None = None
        self.seq = 0
        self.result: dict[str, Any] | None = None
        """The final Response object, once :meth:`finish` or :meth:`fail` ran."""

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return event

    def _snapshot(self, **changes: Any) -> dict[str, Any]:
        return {**self.head, **changes}

    def _index(self, item: dict[str, Any]) -> int:
        return next(i for i, x in enumerate(self.items) if x is item)

    def start(self) -> list[dict[str, Any]]:
        """``response.created`` and ``response.in_progress``."""
        body = self._snapshot()
        return [self._event("response.created", response=body),
                self._event("response.in_progress", response=body)]

    # --- items -------------------------------------------------------------------------
    def _add(self, item: dict[str, Any], part: dict[str, Any] | None) -> list[dict[str, Any]]:
        out = self.close()
        index = len(self.items)
        self.items.append(item)
        self.open = item
        out.append(self._event("response.output_item.added", output_index=index,
                               item=json.loads(json.dumps(item))))
        if part is not None:
            out.append(self._event("response.content_part.added", item_id=item["id"],
                                   output_index=index, content_index=0, part=part))
        return out

    def close(self) -> list[dict[str, Any]]:
        """The done events of the open item (none open: none)."""
        item, self.open = self.open, None
        if item is None:
            return []
        index = self._index(item)
        ids = {"item_id": item["id"], "output_index": index}
        out = []
        if item["type"] == "message":
            part = item["content"][0]
            item["status"] = "incomplete" if self.finish_reason == "length" else "completed"
            out += [self._event("response.output_text.done", **ids, content_index=0,
                                text=part["text"], logprobs=[]),
                    self._event("response.content_part.done", **ids, content_index=0, part=part)]
        elif item["type"] == "reasoning":
            part = item["content"][0]
            item["status"] = "completed"
            out += [self._event("response.reasoning_text.done", **ids, content_index=0,
                                text=part["text"]),
                    self._event("response.content_part.done", **ids, content_index=0, part=part)]
        else:
            item["status"] = "completed"
            out.append(self._event("response.function_call_arguments.done", **ids,
                                   arguments=item["arguments"]))
        out.append(self._event("response.output_item.done", output_index=index, item=item))
        return out

    def _text(self, kind: str, delta: str) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if self.open is None or self.open["type"] != kind:
            if kind == "message":
                item = convert.message_item("", "in_progress")
                item["content"] = []
                part = {"type": "output_text", "text": "", "annotations": []}
            else:
                item = convert.reasoning_item("")
                item["content"], item["status"] = [], "in_progress"
                part = {"type": "reasoning_text", "text": ""}
            out += self._add(item, dict(part))
            item["content"].append(part)
        item = self.open
        assert item is not None
        item["content"][0]["text"] += delta
        ids = {"item_id": item["id"], "output_index": self._index(item), "content_index": 0}
        if kind == "message":
            out.append(self._event("response.output_text.delta", **ids, delta=delta, logprobs=[]))
        else:
            out.append(self._event("response.reasoning_text.delta", **ids, delta=delta))
        return out

    def _tool_call(self, tc: dict[str, Any]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        index = tc.get("index", 0)
        fn = tc.get("function") or {}
        item = self.calls.get(index)
        if item is None:
            item = convert.function_call_item({"id": tc.get("id"), "function": {
                "name": fn.get("name") or "", "arguments": ""}})
            item["status"] = "in_progress"
            self.calls[index] = item
            out += self._add(item, None)
        delta = fn.get("arguments") or ""
        if delta:
            item["arguments"] += delta
            if item is self.open:
                out.append(self._event("response.function_call_arguments.delta",
                                       item_id=item["id"], output_index=self._index(item),
                                       delta=delta))
        return out

    # --- chunks ------------------------------------------------------------------------
    def chunk(self, chunk: dict[str, Any]) -> list[dict[str, Any]]:
        """The events of one ``chat.completion.chunk``."""
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        out: list[dict[str, Any]] = []
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            thought = delta.get("reasoning") or delta.get("reasoning_content")
            if thought:
                out += self._text("reasoning", thought)
            if delta.get("content"):
                out += self._text("message", delta["content"])
            for tc in delta.get("tool_calls") or []:
                out += self._tool_call(tc)
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
        return out

    def finish(self) -> list[dict[str, Any]]:
        """Close what is open and send the whole response (``response.completed``, or
        ``response.incomplete`` when the output was cut at ``max_output_tokens``)."""
        out = self.close()
        if not any(i["type"] in ("message", "function_call") for i in self.items):
            out += self._text("message", "")[:-1]  # an empty answer is an empty message
            out += self.close()
        self.result = convert.finish(self.head, self.items, self.finish_reason, self.usage)
        kind = "response.incomplete" if self.result["status"] == "incomplete" else "response.completed"
        return [*out, self._event(kind, response=self.result)]

    def fail(self, error: dict[str, Any]) -> list[dict[str, Any]]:
        """The chat stream carried ``{"error": {...}}``: ``error`` then ``response.failed``."""
        self.open = None
        message = str(error.get("message") or "the response failed")
        code = error.get("code") or error.get("type") or "server_error"
        self.result = {**convert.finish(self.head, self.items, None, self.usage),
                       "status": "failed", "error": {"code": code, "message": message}}
        return [self._event("error", code=code, message=message, param=error.get("param")),
                self._event("response.failed", response=self.result)]
