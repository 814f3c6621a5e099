"""A Responses request → a :class:`ChatCompletionRequest`, and a chat result → the Response
object, in OpenAI's documented shapes (vLLM's mapping where OpenAI leaves a choice open).

Input: a string is one user message; message items keep their role (``developer`` becomes
``system``: chat templates know no ``developer``), their text parts are joined;
``function_call`` items become an assistant message's ``tool_calls`` (consecutive calls,
and the assistant text right before them, make one assistant turn); ``function_call_output``
items become ``tool`` messages; ``reasoning`` items are dropped from the prompt (as vLLM
does). Anything else (images, files, item references, built-in tools) is refused with a 400
naming the field. Output: a ``reasoning`` item when the chat message had a thought, a
``message`` item when it had text (or nothing else), one ``function_call`` item per call.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from loramux.platform.errors import BadRequest
from loramux.platform.openai.protocol import ChatCompletionRequest
from loramux.platform.openai.responses_api.protocol import ResponsesRequest

ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
TEXT_PARTS = ("input_text", "output_text")
DEFAULT_TEXT = {"format": {"type": "text"}}


def new_id(prefix: str) -> str:
    """``resp_…``, ``msg_…``, ``fc_…``, ``rs_…``: a prefix and 32 hex digits."""
    return f"{prefix}_{uuid.uuid4().hex}"


def _bad(message: str, param: str) -> BadRequest:
    return BadRequest(message, param=param, code="invalid_parameter")


def _text(content: Any, param: str) -> str:
    """A message's content (a string or text parts) as one string."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(f"{param} must be a string or a list of input_text parts", param)
    texts = []
    for j, part in enumerate(content):
        where = f"{param}[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS:
            raise _bad(f"{where}.type: only input_text and output_text parts are supported, "
                       f"got {str(kind)[:40]!r}", f"{where}.type")
        if not isinstance(part.get("text"), str):
            raise _bad(f"{where}.text must be a string", f"{where}.text")
        texts.append(part["text"])
    return "".join(texts)


def _string(item: dict, key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise _bad(f"{where}.{key} must be a string", f"{where}.{key}")
    return value


def _function_call(item: dict, where: str, messages: list[dict]) -> None:
    call = {"id": _string(item, "call_id", where), "type": "function",
            "function": {"name": _string(item, "name", where),
                         "arguments": _string(item, "arguments", where)}}
    last = messages[-1] if messages else None
    if last is not None and last["role"] == "assistant":
        last.setdefault("tool_calls", []).append(call)
    else:
        messages.append({"role": "assistant", "content": "", "tool_calls": [call]})


def input_messages(items: str | list[Any]) -> list[dict[str, Any]]:
    """The chat messages of a request's ``input`` (400 naming the first bad field)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise _bad(f"{where} must be an object", where)
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ROLES:
                raise _bad(f"{where}.role must be user, system, developer or assistant, got "
                           f"{str(role)[:40]!r}", f"{where}.role")
            messages.append({"role": ROLES[role], "content": _text(item.get("content"),
                                                                   f"{where}.content")})
        elif kind == "function_call":
            _function_call(item, where, messages)
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append({"role": "tool", "tool_call_id": _string(item, "call_id", where),
                             "content": _text(output, f"{where}.output")})
        elif kind == "reasoning":
            continue  # a previous thought is not part of the prompt (vLLM drops it too)
        else:
            raise _bad(f"{where}.type: {str(kind)[:40]!r} items are not supported (message, "
                       "function_call, function_call_output and reasoning are)", f"{where}.type")
    return messages


def chat_tools(tools: list[dict[str, Any]] | None) -> tuple[list[dict] | None, list[dict]]:
    """The chat ``tools`` of Responses function tools, and the tools as the response echoes
    them; built-in tools (web_search, file_search, ...) are refused."""
    if not tools:
        return None, []
    chat, echo = [], []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise _bad(f"{where}.type: only function tools are supported, got "
                       f"{str(kind)[:40]!r}", f"{where}.type")
        fn = {"name": _string(tool, "name", where)}
        for key, types in (("description", str), ("parameters", dict), ("strict", bool)):
            value = tool.get(key)
            if value is not None and not isinstance(value, types):
                raise _bad(f"{where}.{key} must be a {types.__name__}", f"{where}.{key}")
            if value is not None:
                fn[key] = value
        chat.append({"type": "function", "function": fn})
        echo.append({"type": "function", "name": fn["name"],
                     "description": fn.get("description"), "parameters": fn.get("parameters"),
                     "strict": fn.get("strict")})
    return chat, echo


def chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    """``auto`` | ``none`` | ``required`` | ``{"type": "function", "name"}`` in chat's shape."""
    if choice is None or choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" \
            and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise _bad("tool_choice must be auto, none, required or {\"type\": \"function\", "
               "\"name\": ...}", "tool_choice")


def response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """Chat's ``response_format`` of ``text.format``."""
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind in ("text", "json_object"):
        return {"type": kind}
    if kind == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise _bad("text.format.schema must be a JSON schema object", "text.format.schema")
        spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": spec}
    raise _bad(f"text.format.type must be text, json_object or json_schema, got "
               f"{str(kind)[:40]!r}", "text.format.type")


@dataclass
class ChatPlan:
    """A Responses request as the chat completion it runs."""

    chat: ChatCompletionRequest
    conversation: list[dict[str, Any]]
    """The stored messages this response continues plus its new input (no instructions)."""
    tools: list[dict[str, Any]]
    """The tools as the response echoes them."""
    warnings: list[str] = field(default_factory=list)


def to_chat(req: ResponsesRequest, history: list[dict[str, Any]]) -> ChatPlan:
    """The chat completion of ``req`` continuing ``history`` (the stored conversation of
    ``previous_response_id``; its instructions are not carried over)."""
    conversation = [*history, *input_messages(req.input)]
    messages = ([{"role": "system", "content": req.instructions}] if req.instructions else [])
    messages += conversation
    if not messages:
        raise _bad("input must not be empty", "input")
    tools, echo = chat_tools(req.tools)
    body: dict[str, Any] = {"model": req.model, "messages": messages, "stream": bool(req.stream)}
    if req.stream:
        body["stream_options"] = {"include_usage": True}
    for name, value in (("max_tokens", req.max_output_tokens), ("temperature", req.temperature),
                        ("top_p", req.top_p), ("user", req.user), ("tools", tools),
                        ("tool_choice", chat_tool_choice(req.tool_choice)),
                        ("parallel_tool_calls", req.parallel_tool_calls),
                        ("response_format", response_format(req.text))):
        if value is not None:
            body[name] = value
    try:
        chat = ChatCompletionRequest(**body)
    except ValidationError as e:
        first = e.errors()[0]
        loc = ".".join(str(p) for p in first.get("loc", ()))
        raise _bad(f"input cannot be run as a chat: {loc}: {first.get('msg')}", "input") from None
    warnings = [f"{name} had no effect: it is not a recognized parameter"
                for name in sorted(req.model_extra or {})]
    return ChatPlan(chat, conversation, echo, warnings)


# --- the answer ------------------------------------------------------------------------
def reasoning_item(text: str, item_id: str | None = None) -> dict[str, Any]:
    return {"id": item_id or new_id("rs"), "type": "reasoning", "summary": [],
            "content": [{"type": "reasoning_text", "text": text}], "status": "completed"}


def message_item(text: str, status: str, item_id: str | None = None) -> dict[str, Any]:
    return {"id": item_id or new_id("msg"), "type": "message", "role": "assistant",
            "status": status, "content": [{"type": "output_text", "text": text,
                                           "annotations": []}]}


def function_call_item(call: dict[str, Any], item_id: str | None = None) -> dict[str, Any]:
    fn = call.get("function") or {}
    return {"id": item_id or new_id("fc"), "type": "function_call",
            "call_id": call.get("id") or new_id("call"), "name": fn.get("name", ""),
            "arguments": fn.get("arguments") or "", "status": "completed"}


def status_of(finish_reason: str | None) -> tuple[str, dict[str, str] | None]:
    """The response's ``status`` and ``incomplete_details`` of the chat finish reason."""
    if finish_reason == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    return "completed", None


def output_items(message: dict[str, Any], finish_reason: str | None) -> list[dict[str, Any]]:
    """The output items of one chat choice's ``message``."""
    items = []
    thought = message.get("reasoning") or message.get("reasoning_content")
    if thought:
        items.append(reasoning_item(thought))
    calls = message.get("tool_calls") or []
    text = message.get("content") or ""
    if text or not calls:
        items.append(message_item(text, "incomplete" if finish_reason == "length" else "completed"))
    items += [function_call_item(c) for c in calls]
    return items


def response_usage(usage: dict[str, Any] | None) -> dict[str, Any] | None:
    """Chat usage → ``{input_tokens, input_tokens_details, output_tokens, ...}``."""
    if usage is None:
        return None
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    reasoning = (usage.get("completion_tokens_details") or {}).get("reasoning_tokens") or 0
    return {"input_tokens": usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": reasoning},
            "total_tokens": usage["total_tokens"]}


def effective(headers: Any) -> dict[str, Any]:
    """The sampling parameters in effect (the chat answer's ``X-LoRAMux-Params``)."""
    try:
        return json.loads(headers.get("x-loramux-params") or "{}")
    except (TypeError, ValueError):
        return {}


def response_head(req: ResponsesRequest, plan: ChatPlan, in_effect: dict[str, Any], *,
                  store: bool) -> dict[str, Any]:
    """What every Response object of ``req`` carries besides its output, status and usage
    (the request's settings echoed; temperature and top_p as in effect)."""
    return {
        "id": new_id("resp"), "object": "response", "created_at": int(time.time()),
        "status": "in_progress", "error": None, "incomplete_details": None,
        "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
        "model": req.model, "output": [],
        "parallel_tool_calls": req.parallel_tool_calls is not False,
        "previous_response_id": req.previous_response_id, "store": store,
        "temperature": in_effect.get("temperature", req.temperature),
        "text": req.text if req.text and req.text.get("format") else DEFAULT_TEXT,
        "tool_choice": req.tool_choice if req.tool_choice is not None else "auto",
        "tools": plan.tools, "top_p": in_effect.get("top_p", req.top_p),
        "truncation": "disabled", "usage": None, "user": req.user,
        "metadata": req.metadata or {},
    }


def finish(head: dict[str, Any], output: list[dict[str, Any]], finish_reason: str | None,
           usage: dict[str, Any] | None) -> dict[str, Any]:
    """The finished Response object."""
    status, details = status_of(finish_reason)
    return {**head, "status": status, "incomplete_details": details, "output": output,
            "usage": response_usage(usage)}


def from_chat_body(head: dict[str, Any], body: dict[str, Any]) -> dict[str, Any]:
    """The Response object of a non-streamed chat completion body."""
    choice = body["choices"][0]
    return finish(head, output_items(choice["message"], choice.get("finish_reason")),
                  choice.get("finish_reason"), body.get("usage"))


def output_messages(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A response's output as the assistant turn the stored conversation continues with
    (its thought dropped, as from any prompt)."""
    text = "".join(part["text"] for item in output if item["type"] == "message"
                   for part in item["content"])
    calls = [{"id": item["call_id"], "type": "function",
              "function": {"name": item["name"], "arguments": item["arguments"]}}
             for item in output if item["type"] == "function_call"]
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if calls:
        message["tool_calls"] = calls
    return [message]
