"""The OpenAI completions and chat completions service over :class:`AsyncEngine`.

Request path: resolve ``model`` → build SamplingParams (preset + request) → tokenize
(chat template for chat) → one engine request per prompt, pumped by a task each
into one queue → either one JSON body or server-sent events ending in
``data: [DONE]``. Engine errors raised while a request is being added (bad
parameter, prompt longer than ``max_model_len``, queue full, bad adapter) surface
before the first byte, so they get their proper HTTP status even when streaming.
A client that disconnects cancels the pump tasks, which aborts the engine requests
and frees their KV blocks at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from loramux.adapters.errors import AdapterValidationError
from loramux.engine.async_engine import AsyncEngine
from loramux.engine.engine import QueueFullError
from loramux.engine.llm import render_chat
from loramux.engine.lora.manager import LoRAError
from loramux.engine.outputs import CompletionOutput, RequestOutput
from loramux.engine.sampling_params import SamplingParams
from loramux.platform.errors import (
    APIError,
    BadRequest,
    ServiceUnavailable,
    Unprocessable,
    param_of,
    to_api_error,
)
from loramux.platform.metrics import Metrics
from loramux.platform.openai.params import KNOWN_PARAMS, BuiltParams, build_params
from loramux.platform.openai.protocol import ChatCompletionRequest, CompletionRequest
from loramux.platform.openai.resolver import Caller, ModelResolver, ServedModel

logger = logging.getLogger(__name__)

_LONG_PROMPT_CHARS = 4096


class SSEResponse(StreamingResponse):
    """Server-sent events that always watch for the client going away, so a disconnect
    cancels the stream (and with it the engine requests) even between two events."""

    media_type = "text/event-stream"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        stream = asyncio.ensure_future(self.stream_response(send))
        watcher = asyncio.ensure_future(self.listen_for_disconnect(receive))
        try:
            await asyncio.wait({stream, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (stream, watcher):
                if not task.done():
                    task.cancel()
            for task in (stream, watcher):
                with contextlib.suppress(asyncio.CancelledError, OSError, Exception):
                    await task
        if stream.done() and not stream.cancelled() and stream.exception() is not None:
            exc = stream.exception()
            if not isinstance(exc, OSError):
                raise exc


def _dumps(data: Any) -> str:
    return json.dumps(data, ensure_ascii=False, separators=(",", ":"))


def sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else _dumps(data)}\n\n"


def _finite(x: float) -> float:
    return x if math.isfinite(x) else -9999.0


@dataclass
class _Track:
    """Timing of one engine request, for metrics and logs."""

    start: float = field(default_factory=time.monotonic)
    first: float | None = None
    end: float | None = None
    prompt_tokens: int = 0
    output_tokens: int = 0

    def update(self, out: RequestOutput) -> None:
        self.prompt_tokens = len(out.prompt_token_ids)
        n = sum(len(o.token_ids) for o in out.outputs)
        if n and self.first is None:
            self.first = time.monotonic()
        self.output_tokens = n
        if out.finished:
            self.end = time.monotonic()


class _Pump:
    """Runs one engine request per prompt as a task each, feeding one queue."""

    def __init__(self, engine: AsyncEngine, prompts: list, params: SamplingParams, rid: str,
                 served: ServedModel) -> None:
        self.queue: asyncio.Queue = asyncio.Queue()
        self.tracks = [_Track() for _ in prompts]
        self.tasks = [
            asyncio.ensure_future(self._run(engine, i, p, params, f"{rid}-{i}", served))
            for i, p in enumerate(prompts)
        ]
        self.remaining = len(prompts)

    async def _run(self, engine, i, prompt, params, rid, served) -> None:
        try:
            async for out in engine.generate(prompt, params, request_id=rid, lora_request=served.lora):
                self.tracks[i].update(out)
                self.queue.put_nowait((i, out))
            self.queue.put_nowait((i, None))
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # handed to the consumer
            self.queue.put_nowait((i, exc))

    async def next(self) -> tuple[int, RequestOutput | None]:
        """The next (prompt index, output); (i, None) when prompt i is done. Raises the
        engine's error of any prompt."""
        i, item = await self.queue.get()
        if isinstance(item, BaseException):
            raise item
        if item is None:
            self.remaining -= 1
        return i, item

    async def next_batch(self) -> list[tuple[int, RequestOutput | None]]:
        """Wait for one item, then take every item already queued (streaming sends the
        latest snapshot of each prompt, so a slow client gets fewer, larger chunks)."""
        items = [await self.next()]
        while not self.queue.empty():
            i, item = self.queue.get_nowait()
            if isinstance(item, BaseException):
                raise item
            if item is None:
                self.remaining -= 1
            items.append((i, item))
        return items

    def cancel(self) -> None:
        for t in self.tasks:
            if not t.done():
                t.cancel()


def engine_error(exc: BaseException, retry_after: int, prompt_param: str) -> APIError:
    """The HTTP error for an exception raised by the engine while adding or running: the
    error table, plus the 429's ``Retry-After`` and the parameter a ValueError names."""
    if isinstance(exc, (LoRAError, AdapterValidationError)):
        return Unprocessable(f"the adapter cannot be served: {exc}", param="model")
    if isinstance(exc, ValueError):
        msg = str(exc)
        if "maximum context length" in msg:
            param = "max_tokens" if "max_tokens" in msg else prompt_param
            return BadRequest(msg, param=param, code="context_length_exceeded")
        return BadRequest(msg, param=param_of(msg, KNOWN_PARAMS), code="invalid_parameter")
    err = to_api_error(exc)
    if isinstance(exc, QueueFullError):
        err.message = f"{exc}; retry after {retry_after} s"
        err.headers = {"Retry-After": str(retry_after)}
    return err


async def _wait_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


class OpenAIServing:
    """Completions and chat completions for one engine."""

    def __init__(
        self,
        engine: AsyncEngine,
        resolver: ModelResolver,
        metrics: Metrics,
        *,
        fingerprint: str,
        retry_after: int = 1,
        max_prompts: int = 64,
    ) -> None:
        self.engine = engine
        self.tokenizer = engine.engine.tokenizer
        self.max_model_len = engine.engine.max_model_len
        self.resolver = resolver
        self.metrics = metrics
        self.fingerprint = fingerprint
        self.retry_after = retry_after
        self.max_prompts = max_prompts
        self._token_text: dict[int, str] = {}

    # --- tokenization -------------------------------------------------------------------
    def token_text(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            tok = self.tokenizer.convert_ids_to_tokens(token_id)
            text = self.tokenizer.convert_tokens_to_string([tok]) if tok is not None else ""
            self._token_text[token_id] = text
        return text

    async def _encode(self, text: str) -> list[int]:
        if len(text) > _LONG_PROMPT_CHARS:
            return await run_in_threadpool(lambda: self.tokenizer(text).input_ids)
        return self.tokenizer(text).input_ids

    async def _completion_prompts(self, prompt) -> list[dict]:
        if isinstance(prompt, str):
            items: list = [prompt]
        elif prompt and all(isinstance(t, int) for t in prompt):
            items = [list(prompt)]
        else:
            items = list(prompt)
        if not items:
            raise BadRequest("prompt must not be empty", param="prompt")
        if len(items) > self.max_prompts:
            raise BadRequest(
                f"prompt holds {len(items)} prompts; at most {self.max_prompts} per request",
                param="prompt",
            )
        out = []
        for item in items:
            if isinstance(item, str):
                out.append({"prompt": item, "prompt_token_ids": await self._encode(item)})
            else:
                out.append({"prompt_token_ids": list(item)})
        return out

    def _chat_prompt(self, req: ChatCompletionRequest) -> dict:
        conversation = []
        for i, m in enumerate(req.messages):
            content = m.content
            if isinstance(content, list):
                parts = []
                for part in content:
                    if part.get("type") != "text" or not isinstance(part.get("text"), str):
                        raise BadRequest(
                            f"messages[{i}].content: only text parts are supported, got "
                            f"{str(part.get('type'))[:40]!r}",
                            param=f"messages.{i}.content",
                        )
                    parts.append(part["text"])
                content = "".join(parts)
            conversation.append({"role": m.role, "content": content or ""})
        try:
            ids = render_chat(
                self.tokenizer, conversation, bool(req.add_generation_prompt), req.chat_template,
                req.chat_template_kwargs,
            )
        except Exception as e:  # template errors (e.g. roles that must alternate)
            raise BadRequest(f"messages cannot be rendered with the chat template: {e}",
                             param="messages") from None
        return {"prompt_token_ids": ids}

    # --- entry points ---------------------------------------------------------------------
    async def completions(self, req: CompletionRequest, caller: Caller, request: Request) -> Response:
        served = await self.resolver.resolve(caller, req.model)
        built = build_params(req, served.preset, default_max_tokens=16)
        prompts = await self._completion_prompts(req.prompt)
        if req.echo and built.params.logprobs is not None:
            built.params = built.params.clone(prompt_logprobs=built.params.logprobs)
        ctx = _Ctx("cmpl", req.model, served, built, prompts, bool(req.echo), "prompt", "completions")
        return await self._respond(ctx, req, request)

    async def chat(self, req: ChatCompletionRequest, caller: Caller, request: Request) -> Response:
        served = await self.resolver.resolve(caller, req.model)
        built = build_params(req, served.preset, default_max_tokens=None)
        if len(json.dumps([m.model_dump() for m in req.messages])) > _LONG_PROMPT_CHARS:
            prompt = await run_in_threadpool(self._chat_prompt, req)
        else:
            prompt = self._chat_prompt(req)
        ctx = _Ctx("chatcmpl", req.model, served, built, [prompt], False, "messages", "chat")
        return await self._respond(ctx, req, request)

    def _check_lengths(self, ctx: _Ctx) -> None:
        """min_tokens must fit in the context (the engine would not stop at max_model_len)."""
        min_tokens = ctx.built.params.min_tokens
        if ctx.built.params.max_tokens is not None:
            return  # min_tokens <= max_tokens, which the engine checks against the context
        for p in ctx.prompts:
            if len(p["prompt_token_ids"]) + min_tokens > self.max_model_len:
                raise BadRequest(
                    f"This model's maximum context length is {self.max_model_len} tokens. However, "
                    f"you requested at least {len(p['prompt_token_ids']) + min_tokens} tokens "
                    f"({len(p['prompt_token_ids'])} in the prompt, min_tokens={min_tokens}).",
                    param="min_tokens", code="context_length_exceeded",
                )

    async def _respond(self, ctx: _Ctx, req, request: Request) -> Response:
        if not self.engine.is_running:
            raise ServiceUnavailable("the engine is not running", code="engine_dead")
        self._check_lengths(ctx)
        headers = ctx.built.headers()
        pump = _Pump(self.engine, ctx.prompts, ctx.built.params, ctx.rid, ctx.served)
        try:
            if req.stream:
                first = await self._until_disconnect(self._prime(pump, ctx), request)
                if first is None:
                    pump.cancel()
                    self._record(ctx, pump, "cancelled")
                    return Response(status_code=499)
                include_usage = bool(req.stream_options and req.stream_options.include_usage)
                continuous = bool(req.stream_options and req.stream_options.continuous_usage_stats)
                return SSEResponse(
                    self._stream(pump, ctx, first, include_usage, continuous), headers=headers,
                )
            finals = await self._until_disconnect(self._collect(pump, ctx), request)
            if finals is None:
                pump.cancel()
                self._record(ctx, pump, "cancelled")
                return Response(status_code=499)
        except BaseException as exc:
            pump.cancel()
            self._record(ctx, pump, _status_of(exc))
            if isinstance(exc, (asyncio.CancelledError, KeyboardInterrupt, SystemExit)):
                raise
            raise engine_error(exc, self.retry_after, ctx.prompt_param) from None
        self._record(ctx, pump, "ok")
        body = self._completion_body(ctx, finals) if ctx.kind == "cmpl" else self._chat_body(ctx, finals)
        return JSONResponse(body, headers=headers)

    async def _until_disconnect(self, coro, request: Request):
        """Run ``coro``; None when the client went away first (the work is cancelled)."""
        work = asyncio.ensure_future(coro)
        watcher = asyncio.ensure_future(_wait_disconnect(request.receive))
        try:
            await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            work.cancel()
            watcher.cancel()
            raise
        watcher.cancel()
        if not work.done():
            work.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await work
            logger.info("client disconnected; request aborted")
            return None
        return work.result()

    async def _prime(self, pump: _Pump, ctx: _Ctx) -> list[tuple[int, RequestOutput | None]]:
        """Wait until every prompt's request was added and produced its first output, so
        that add-time errors become HTTP errors; returns the outputs seen so far."""
        seen: set[int] = set()
        buffered = []
        while len(seen) < len(ctx.prompts):
            i, out = await pump.next()
            buffered.append((i, out))
            seen.add(i)
        return buffered

    async def _collect(self, pump: _Pump, ctx: _Ctx) -> list[RequestOutput]:
        finals: list[RequestOutput | None] = [None] * len(ctx.prompts)
        while pump.remaining:
            i, out = await pump.next()
            if out is not None:
                finals[i] = out
        return finals  # type: ignore[return-value]

    def _record(self, ctx: _Ctx, pump: _Pump, status: str) -> None:
        if ctx.recorded:
            return
        ctx.recorded = True
        label = ctx.served.label
        for t in pump.tracks:
            ttft = (t.first - t.start) if t.first is not None else None
            tpot = None
            if t.first is not None and t.end is not None and t.output_tokens > 1:
                tpot = (t.end - t.first) / (t.output_tokens - 1)
            e2e = (t.end - t.start) if t.end is not None else None
            self.metrics.observe_request(
                label, ctx.endpoint, status, prompt_tokens=t.prompt_tokens,
                generated_tokens=t.output_tokens, ttft=ttft, tpot=tpot, e2e=e2e,
            )
        logger.info(
            "%s %s %s", ctx.endpoint, ctx.model, status,
            extra={
                "id": ctx.rid, "model": ctx.model, "adapter": label, "status": status,
                "prompt_tokens": sum(t.prompt_tokens for t in pump.tracks),
                "completion_tokens": sum(t.output_tokens for t in pump.tracks),
                "ttft_ms": _ms(min((t.first - t.start for t in pump.tracks if t.first), default=None)),
            },
        )

    # --- streaming ----------------------------------------------------------------------
    async def _stream(self, pump: _Pump, ctx: _Ctx, first, include_usage: bool,
                      continuous: bool) -> AsyncIterator[str]:
        state = _StreamState(ctx)
        status = "ok"
        # every chunk shares its head: render it once
        prefix = _dumps(self._head(ctx, stream=True))[:-1] + ',"choices":['
        try:
            pending = list(first)
            while True:
                if not pending:
                    if not pump.remaining:
                        break
                    pending = await pump.next_batch()
                latest: dict[int, RequestOutput] = {}
                for i, out in pending:  # cumulative snapshots: the last one says it all
                    if out is not None:
                        latest[i] = out
                pending = []
                parts = []
                for i, out in latest.items():
                    for choice in self._chunks(ctx, state, i, out):
                        tail = ""
                        if include_usage:
                            tail = ',"usage":' + (_dumps(state.usage()) if continuous else "null")
                        parts.append(f"data: {prefix}{_dumps(choice)}]{tail}}}\n\n")
                if parts:
                    yield "".join(parts)
            if include_usage:
                yield sse({**self._head(ctx, stream=True), "choices": [], "usage": state.usage()})
            yield sse("[DONE]")
        except asyncio.CancelledError:
            status = "cancelled"
            raise
        except GeneratorExit:
            status = "cancelled"
            raise
        except BaseException as exc:
            status = _status_of(exc)
            err = engine_error(exc, self.retry_after, ctx.prompt_param)
            yield sse(err.body())
            yield sse("[DONE]")
        finally:
            pump.cancel()
            self._record(ctx, pump, status)

    def _head(self, ctx: _Ctx, stream: bool) -> dict[str, Any]:
        obj = {
            ("cmpl", False): "text_completion", ("cmpl", True): "text_completion",
            ("chatcmpl", False): "chat.completion", ("chatcmpl", True): "chat.completion.chunk",
        }[(ctx.kind, stream)]
        return {
            "id": ctx.rid, "object": obj, "created": ctx.created, "model": ctx.model,
            "system_fingerprint": self.fingerprint,
        }

    def _chunks(self, ctx: _Ctx, state: _StreamState, i: int, out: RequestOutput) -> list[dict]:
        """The ``choices`` entries to send for a new snapshot of prompt ``i``."""
        state.prompt_tokens[i] = len(out.prompt_token_ids)
        chunks = []
        n = ctx.built.params.n
        for o in out.outputs:
            index = i * n + o.index if ctx.kind == "cmpl" else o.index
            sent_text, sent_tok = state.sent.get(index, (0, 0))
            first_chunk = index not in state.sent
            delta = o.text[sent_text:]
            new_tokens = o.token_ids[sent_tok:]
            state.completion_tokens[index] = len(o.token_ids)
            finish = o.finish_reason if out.finished or o.finish_reason else None
            if finish == "abort":
                finish = None
            if not delta and not new_tokens and finish is None and not first_chunk:
                continue
            state.sent[index] = (len(o.text), len(o.token_ids))
            if finish is not None:
                state.sent[index] = (len(o.text), len(o.token_ids))
            lp = o.logprobs[sent_tok:] if o.logprobs is not None else None
            new_ids = o.token_ids[sent_tok:]
            if ctx.kind == "cmpl":
                text = delta
                offset = sent_text
                if first_chunk and ctx.echo:
                    prompt_text = self._prompt_text(ctx.prompts[i])
                    text = prompt_text + text
                    if lp is not None and out.prompt_logprobs is not None:
                        new_ids = list(out.prompt_token_ids) + new_ids
                        lp = list(out.prompt_logprobs) + lp
                    else:
                        offset += len(prompt_text)
                choice = {
                    "index": index, "text": text,
                    "logprobs": self._completion_logprobs(new_ids, lp, offset) if lp is not None else None,
                    "finish_reason": finish,
                    "stop_reason": o.stop_reason if finish is not None else None,
                }
            else:
                d: dict[str, Any] = {}
                if first_chunk:
                    d["role"] = "assistant"
                if delta or first_chunk:
                    d["content"] = delta
                choice = {
                    "index": index, "delta": d,
                    "logprobs": self._chat_logprobs(new_ids, lp, ctx.built.params.logprobs or 0)
                    if lp is not None else None,
                    "finish_reason": finish,
                    "stop_reason": o.stop_reason if finish is not None else None,
                }
            chunks.append(choice)
        return chunks

    # --- bodies -------------------------------------------------------------------------
    def _usage(self, finals: list[RequestOutput]) -> dict[str, int]:
        prompt = sum(len(f.prompt_token_ids) for f in finals)
        completion = sum(len(o.token_ids) for f in finals for o in f.outputs)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def _completion_body(self, ctx: _Ctx, finals: list[RequestOutput]) -> dict:
        choices = []
        n = ctx.built.params.n
        for i, final in enumerate(finals):
            prefix = self._prompt_text(ctx.prompts[i]) if ctx.echo else ""
            for o in final.outputs:
                logprobs = None
                if o.logprobs is not None:
                    if ctx.echo and final.prompt_logprobs is not None:
                        logprobs = self._completion_logprobs(
                            list(final.prompt_token_ids) + o.token_ids,
                            list(final.prompt_logprobs) + o.logprobs, 0)
                    else:
                        logprobs = self._completion_logprobs(o.token_ids, o.logprobs, len(prefix))
                choices.append({
                    "index": i * n + o.index,
                    "text": prefix + o.text,
                    "logprobs": logprobs,
                    **({"prompt_logprobs": self._prompt_logprobs(final)}
                       if ctx.built.params.prompt_logprobs is not None and not ctx.echo else {}),
                    "finish_reason": _finish(o),
                    "stop_reason": o.stop_reason,
                })
        choices.sort(key=lambda c: c["index"])
        return {**self._head(ctx, stream=False), "choices": choices, "usage": self._usage(finals)}

    def _chat_body(self, ctx: _Ctx, finals: list[RequestOutput]) -> dict:
        final = finals[0]
        choices = []
        for o in sorted(final.outputs, key=lambda o: o.index):
            choices.append({
                "index": o.index,
                "message": {"role": "assistant", "content": o.text},
                "logprobs": self._chat_logprobs(o.token_ids, o.logprobs, ctx.built.params.logprobs or 0)
                if o.logprobs is not None else None,
                "finish_reason": _finish(o),
                "stop_reason": o.stop_reason,
            })
        body = {**self._head(ctx, stream=False), "choices": choices, "usage": self._usage(finals)}
        if ctx.built.params.prompt_logprobs is not None:
            body["prompt_logprobs"] = self._prompt_logprobs(final)
        return body

    def _prompt_logprobs(self, out: RequestOutput) -> list | None:
        """vLLM's shape: None for the first prompt token, then token id -> logprob, rank, text."""
        if out.prompt_logprobs is None:
            return None
        return [
            None if entry is None else {
                str(t): {"logprob": _finite(lp.logprob), "rank": lp.rank,
                         "decoded_token": self.token_text(t)}
                for t, lp in entry.items()
            }
            for entry in out.prompt_logprobs
        ]

    def _prompt_text(self, prompt: dict) -> str:
        if prompt.get("prompt") is not None:
            return prompt["prompt"]
        return self.tokenizer.decode(prompt["prompt_token_ids"])

    # --- logprobs -------------------------------------------------------------------------
    def _completion_logprobs(self, token_ids: list[int], logprobs, offset: int) -> dict:
        tokens, token_lps, tops, offsets = [], [], [], []
        for tid, entry in zip(token_ids, logprobs, strict=False):
            text = self.token_text(tid)
            tokens.append(text)
            if entry is None:  # the first prompt token has no logprob
                token_lps.append(None)
                tops.append(None)
            else:
                token_lps.append(_finite(entry[tid].logprob) if tid in entry else None)
                tops.append({self.token_text(t): _finite(lp.logprob) for t, lp in entry.items()})
            offsets.append(offset)
            offset += len(text)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops,
                "text_offset": offsets}

    def _chat_logprobs(self, token_ids: list[int], logprobs, n_top: int) -> dict:
        content = []
        for tid, entry in zip(token_ids, logprobs, strict=False):
            text = self.token_text(tid)
            chosen = entry.get(tid)
            ranked = sorted(
                ((t, lp) for t, lp in entry.items() if lp.rank is not None and lp.rank <= n_top),
                key=lambda x: x[1].rank,
            )
            top = [
                {"token": self.token_text(t), "logprob": _finite(lp.logprob),
                 "bytes": list(self.token_text(t).encode("utf-8"))}
                for t, lp in ranked[:n_top]
            ]
            content.append({
                "token": text,
                "logprob": _finite(chosen.logprob) if chosen is not None else -9999.0,
                "bytes": list(text.encode("utf-8")),
                "top_logprobs": top,
            })
        return {"content": content, "refusal": None}


def _finish(o: CompletionOutput) -> str | None:
    return o.finish_reason if o.finish_reason != "abort" else None


def _status_of(exc: BaseException) -> str:
    if isinstance(exc, asyncio.CancelledError):
        return "cancelled"
    if isinstance(exc, QueueFullError):
        return "rejected"
    if isinstance(exc, (ValueError, APIError)):
        return "invalid"
    return "error"


def _ms(seconds: float | None) -> float | None:
    return round(seconds * 1000, 2) if seconds is not None else None


@dataclass
class _Ctx:
    kind: str  # cmpl | chatcmpl
    model: str
    served: ServedModel
    built: BuiltParams
    prompts: list[dict]
    echo: bool
    prompt_param: str
    endpoint: str
    rid: str = ""
    created: int = field(default_factory=lambda: int(time.time()))
    recorded: bool = False

    def __post_init__(self) -> None:
        self.rid = f"{self.kind}-{uuid.uuid4().hex}"


@dataclass
class _StreamState:
    ctx: _Ctx
    sent: dict[int, tuple[int, int]] = field(default_factory=dict)
    prompt_tokens: dict[int, int] = field(default_factory=dict)
    completion_tokens: dict[int, int] = field(default_factory=dict)

    def usage(self) -> dict[str, int]:
        p = sum(self.prompt_tokens.values())
        c = sum(self.completion_tokens.values())
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}
