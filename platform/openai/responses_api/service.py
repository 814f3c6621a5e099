"""``ResponsesService``: the Responses API over :meth:`OpenAIServing.chat`.

A request becomes one chat completion (``convert.to_chat``) run with
``endpoint="responses"`` (its metrics and usage record say so); the chat answer becomes the
Response object (``convert.from_chat_body``), or its stream becomes Responses events
(``events.ResponseEvents``). Errors raised before the first byte are the chat path's, in
the OpenAI shape (a prompt past the context is its 400, ``param: "input"``).

Storing (``store: true``, the default): the response and its conversation (the stored
messages it continued, its input, its output as an assistant turn) are written to the
registry per tenant, in the database bulkhead, before the answer (or the stream's last
event) is sent, so a ``previous_response_id`` sent right after always finds it. A write that
fails never fails the answer: it is logged, the body says ``"store": false`` and (not
streamed) the ``X-LoRAMux-Stored: false`` header and a warning say why. Reading a
``previous_response_id`` while the database is down is a 503 with ``Retry-After``: the
conversation cannot be continued without it. Caps and eviction: ``registry.stored_responses``.

Anonymous callers (``--allow-anonymous``) and servers without a registry store nothing:
vLLM keeps responses in process memory for anyone, but here a stored conversation belongs
to a tenant, and one shared anonymous store would let any anonymous caller read (and
continue) any other's conversation by id. So their answers say ``"store": false`` with a
warning, and a ``previous_response_id`` from them is a 404, as is any id of another tenant,
an unknown, deleted or evicted id.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from loramux.platform.bulkheads import Dependencies
from loramux.platform.errors import APIError, NotFound
from loramux.platform.identity import Caller
from loramux.platform.openai.responses_api import convert
from loramux.platform.openai.responses_api.events import ResponseEvents, sse_event
from loramux.platform.openai.responses_api.protocol import ResponsesRequest
from loramux.platform.openai.serving import OpenAIServing
from loramux.platform.openai.streaming import SSEResponse
from loramux.registry.stored_responses import ResponseStoreLimits

if TYPE_CHECKING:
    from loramux.registry.service import RegistryService

logger = logging.getLogger(__name__)

STORED_HEADER = "X-LoRAMux-Stored"
WARNINGS_HEADER = "X-LoRAMux-Warnings"
_MAX_HEADER = 4000


def store_limits(settings: Any) -> ResponseStoreLimits:
    """The store caps of these settings (their fields are ``Settings`` fields)."""
    return ResponseStoreLimits(**{f.name: getattr(settings, f.name)
                                  for f in dataclasses.fields(ResponseStoreLimits)})


def _not_found(response_id: str, param: str | None) -> NotFound:
    return NotFound(f"Response with id '{response_id[:80]}' not found.", param=param,
                    code="response_not_found")


def _headers(chat: Response, warnings: list[str]) -> dict[str, str]:
    """The chat answer's own headers (parameters in effect, version, timing) with our
    warnings added to its."""
    headers = {k: v for k, v in chat.headers.items() if k.lower().startswith("x-loramux-")}
    merged = json.loads(headers.pop("x-loramux-warnings", "[]")) + warnings
    if merged:
        headers[WARNINGS_HEADER] = json.dumps(merged, separators=(",", ":"))[:_MAX_HEADER]
    return headers


_PARAMS = {"max_tokens": "max_output_tokens", "response_format": "text.format",
           "min_tokens": "input"}
"""Chat field → the Responses field it came from (``min_tokens``: the chat path names it
when the prompt alone fills the context; a Responses request cannot set it)."""


def _responses_param(param: str | None) -> str | None:
    """The Responses request's name of a chat error's ``param``."""
    if param is None:
        return None
    if param == "messages" or param.startswith("messages."):
        return "input"
    return _PARAMS.get(param, param)


def _data(text: str) -> list[str]:
    """The ``data:`` payloads of one piece of a chat SSE stream."""
    return [line[6:] for block in text.split("\n\n") for line in block.splitlines()
            if line.startswith("data: ")]


class ResponsesService:
    """``POST /v1/responses``, ``GET`` and ``DELETE /v1/responses/{id}`` for one server."""

    def __init__(self, chat: OpenAIServing, registry: RegistryService | None,
                 deps: Dependencies, limits: ResponseStoreLimits | None = None) -> None:
        """``registry`` None: nothing is stored (every id is unknown)."""
        self.chat = chat
        self.registry = registry
        self.deps = deps
        self.limits = limits or ResponseStoreLimits()

    def _can_store(self, caller: Caller) -> bool:
        return self.registry is not None and caller.tenant_id is not None

    async def _conversation(self, caller: Caller, response_id: str) -> list[dict[str, Any]]:
        """The stored messages of ``previous_response_id`` (404 unless the caller's)."""
        if not self._can_store(caller):
            raise _not_found(response_id, "previous_response_id")
        record = await self.deps.db.call(self.registry.get_stored_response,  # type: ignore[union-attr]
                                         caller.tenant_id, response_id)
        if record is None:
            raise _not_found(response_id, "previous_response_id")
        return list(record.conversation.get("messages") or [])

    # --- create ------------------------------------------------------------------------
    async def create(self, req: ResponsesRequest, caller: Caller, request: Request) -> Response:
        """Run the request as a chat completion: a JSONResponse with the Response object,
        or with ``stream`` the Responses events. Called by the route."""
        history = []
        if req.previous_response_id is not None:
            history = await self._conversation(caller, req.previous_response_id)
        plan = convert.to_chat(req, history)
        store = bool(req.store)
        if store and not self._can_store(caller):
            store = False
            plan.warnings.append("store had no effect: only a tenant's responses are stored "
                                 "(this caller has no tenant or the server no registry)")
        try:
            chat = await self.chat.chat(plan.chat, caller, request, endpoint="responses")
        except APIError as err:
            err.param = _responses_param(err.param)
            raise
        head = convert.response_head(req, plan, convert.effective(chat.headers), store=store)
        headers = _headers(chat, plan.warnings)
        if isinstance(chat, SSEResponse):
            events = ResponseEvents(head)
            return SSEResponse(self._stream(chat, events, plan, caller), headers=headers)
        if not isinstance(chat, JSONResponse):
            return chat  # the client went away (499)
        result = convert.from_chat_body(head, json.loads(chat.body))
        if store:
            why = await self._store(caller, result, plan)
            headers[STORED_HEADER] = "false" if why else "true"
            if why:
                merged = json.loads(headers.get(WARNINGS_HEADER, "[]")) + [why]
                headers[WARNINGS_HEADER] = json.dumps(merged, separators=(",", ":"))[:_MAX_HEADER]
        return JSONResponse(result, headers=headers)

    async def _store(self, caller: Caller, result: dict[str, Any], plan: convert.ChatPlan) -> str | None:
        """Store a finished response; None when stored, else why not (the body then says
        ``"store": false``). Never raises: the answer goes out either way."""
        conversation = {"messages": [*plan.conversation, *convert.output_messages(result["output"])]}
        try:
            done = await self.deps.db.call(
                self.registry.store_response, caller.tenant_id, result["id"],  # type: ignore[union-attr]
                model=result["model"], previous_response_id=result["previous_response_id"],
                body=result, conversation=conversation, limits=self.limits)
        except Exception as exc:
            logger.warning("response %s was not stored: %s: %s", result["id"],
                           type(exc).__name__, exc)
            result["store"] = False
            return "store had no effect: the database is unavailable; this response was not stored"
        if not done.stored:
            logger.warning("response %s was not stored: %s", result["id"], done.reason)
            result["store"] = False
            return f"store had no effect: {done.reason}"
        if done.evicted:
            logger.info("stored response %s; evicted %d older ones of tenant %s", result["id"],
                        len(done.evicted), caller.tenant_id)
        return None

    async def _stream(self, chat: SSEResponse, events: ResponseEvents, plan: convert.ChatPlan,
                      caller: Caller) -> AsyncIterator[str]:
        """The chat stream's chunks as Responses events; the response is stored before the
        last event. Closing this closes the chat stream (which ends the engine request)."""
        inner = chat.body_iterator
        try:
            yield "".join(sse_event(e) for e in events.start())
            failed = False
            async for piece in inner:
                out = []
                for data in _data(piece if isinstance(piece, str) else piece.decode()):
                    if data == "[DONE]":
                        continue
                    obj = json.loads(data)
                    if "error" in obj and "choices" not in obj:
                        out += events.fail(obj["error"] or {})
                        failed = True
                        break
                    out += events.chunk(obj)
                if out:
                    yield "".join(sse_event(e) for e in out)
                if failed:
                    return
            last = events.finish()
            if events.head["store"] and events.result is not None:
                await self._store(caller, events.result, plan)
            yield "".join(sse_event(e) for e in last)
        finally:
            await inner.aclose()  # type: ignore[attr-defined]

    # --- stored responses ----------------------------------------------------------------
    async def retrieve(self, response_id: str, caller: Caller) -> dict[str, Any]:
        """``GET /v1/responses/{id}``: the stored Response object (404 unless the caller's)."""
        if not self._can_store(caller):
            raise _not_found(response_id, "response_id")
        record = await self.deps.db.call(self.registry.get_stored_response,  # type: ignore[union-attr]
                                         caller.tenant_id, response_id)
        if record is None:
            raise _not_found(response_id, "response_id")
        return record.body

    async def delete(self, response_id: str, caller: Caller) -> dict[str, Any]:
        """``DELETE /v1/responses/{id}`` (404 unless the caller's)."""
        if not self._can_store(caller):
            raise _not_found(response_id, "response_id")
        deleted = await self.deps.db.call(self.registry.delete_stored_response,  # type: ignore[union-attr]
                                          caller.tenant_id, response_id)
        if not deleted:
            raise _not_found(response_id, "response_id")
        return {"id": response_id, "object": "response", "deleted": True}
