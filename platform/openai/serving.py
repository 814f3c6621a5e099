"""The OpenAI completions and chat completions service over :class:`AsyncEngine`.

Request path: resolve ``model`` → build SamplingParams (preset + request) → tokenize
(chat template for chat) → one engine request per prompt, pumped by a task each
into one queue → either one JSON body or server-sent events ending in
``data: [DONE]``. Engine errors raised while a request is being added (bad
parameter, prompt longer than ``max_model_len``, queue full, bad adapter) surface
before the first byte, so they get their proper HTTP status even when streaming; every
error is answered, and labelled in the metrics, by the one table (``errors.py``).
A client that disconnects cancels the pump tasks, which aborts the engine requests
and frees their KV blocks at once. Prompts are built in ``prompts``, outputs moved in
``streaming`` and rendered in ``responses`` / ``logprobs``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from loramux.engine.async_engine import AsyncEngine
from loramux.engine.outputs import RequestOutput
from loramux.platform.error_handlers import metric_label, to_api_error
from loramux.platform.errors import DEFAULT_CONTEXT, BadRequest, ErrorContext, ServiceUnavailable
from loramux.platform.identity import Caller
from loramux.platform.metrics import Metrics
from loramux.platform.openai.chat_output import ChatParsing
from loramux.platform.openai.gate import RequestGate
from loramux.platform.openai.params import build_params
from loramux.platform.openai.prompts import LONG_PROMPT_CHARS, PromptBuilder
from loramux.platform.openai.protocol import ChatCompletionRequest, CompletionRequest
from loramux.platform.openai.reasoning_gate import gate_after_thought
from loramux.platform.openai.resolver import ModelResolver, ServedModel
from loramux.platform.openai.responses import RequestContext, ResponseRenderer, StreamState
from loramux.platform.openai.streaming import Pump, SSEResponse, dumps, sse, until_disconnect
from loramux.platform.openai.timing import PHASES, TIMING_HEADER, timing_header
from loramux.platform.openai.tool_config import ParsingConfig
from loramux.platform.openai.tool_request import plan_tools
from loramux.platform.openai.versions import VERSION_HEADER, pinned_version
from loramux.platform.usage.recorder import UsageRecorder
from loramux.platform.usage.records import usage_record

logger = logging.getLogger(__name__)


def _fairness_key(caller: Caller) -> str | None:
    return str(caller.tenant_id) if caller.tenant_id is not None else None


class OpenAIServing:
    """Completions and chat completions for one engine."""

    def __init__(
        self,
        engine: AsyncEngine,
        resolver: ModelResolver,
        metrics: Metrics,
        *,
        fingerprint: str,
        gate: RequestGate,
        errors: ErrorContext = DEFAULT_CONTEXT,
        max_prompts: int = 64,
        usage: UsageRecorder | None = None,
        parsing: ParsingConfig | None = None,
    ) -> None:
        """``usage``: where each finished request's usage record goes (None: nowhere);
        ``errors``: the server's Retry-After values for the error table's answers;
        ``parsing``: the server's tool-call and reasoning parsers (adapters may name their own)."""
        self.engine = engine
        self.parsing = parsing or ParsingConfig()
        self.usage = usage
        self.max_model_len = engine.max_model_len
        self.resolver = resolver
        self.metrics = metrics
        self.errors = errors
        self.gate = gate
        self.prompts = PromptBuilder(engine.tokenizer, max_prompts)
        self.render = ResponseRenderer(engine.tokenizer, fingerprint)

    # --- entry points ---------------------------------------------------------------------
    async def completions(self, req: CompletionRequest, caller: Caller, request: Request) -> Response:
        served = await self.resolver.resolve(caller, req.model, user=req.user,
                                             pinned=pinned_version(request.headers))
        built = build_params(req, served.preset, default_max_tokens=16)
        tokenizer = await self._tokenizer(served)
        prompts = await self.prompts.using(tokenizer).completion_prompts(req.prompt)
        if req.echo and built.params.logprobs is not None:
            built.params = built.params.clone(prompt_logprobs=built.params.logprobs)
        self.gate.check_caps(built.params)
        ctx = RequestContext("cmpl", req.model, served, built, prompts, bool(req.echo), "prompt", "completions",
                             fairness_key=_fairness_key(caller), caller=caller,
                             render=self.render.using(tokenizer))
        return await self._respond(ctx, req, request, caller)

    async def chat(self, req: ChatCompletionRequest, caller: Caller, request: Request, *,
                   endpoint: str = "chat") -> Response:
        """A chat completion: a JSONResponse, or an SSEResponse when ``req.stream``. Errors
        raised before the first byte are :class:`APIError`s. ``endpoint``: the metrics and
        usage-record label (the Responses API passes ``responses``)."""
        served = await self.resolver.resolve(caller, req.model, user=req.user,
                                             pinned=pinned_version(request.headers))
        config = self.parsing.for_model(served.tool_call_parser, served.reasoning_parser)
        plan = plan_tools(req, config, self.gate.limits.max_tools)
        tokenizer = await self._tokenizer(served)
        parsing = ChatParsing(plan, config.reasoning_parser_class(), tokenizer,
                              req.chat_template_kwargs,
                              include_reasoning=req.include_reasoning is not False)
        built = build_params(req, served.preset, default_max_tokens=None,
                             tool_constraint=plan.constraint)
        if req.include_reasoning is False and parsing.reasoning_cls is None:
            built.warnings.append("include_reasoning had no effect: no reasoning parser is in "
                                  "effect (--reasoning-parser)")
        if req.parallel_tool_calls is not None and not plan.parses:
            built.warnings.append("parallel_tool_calls had no effect: no tool calls are parsed "
                                  "for this request")
        if parsing.keep_special_tokens:  # the parsers' markers may be special tokens
            built.params = built.params.clone(skip_special_tokens=False)
        self.gate.check_caps(built.params)
        prompt = await self._chat_prompt(req, served, plan.template_tools(config), tokenizer)
        if parsing.reasoning_cls is not None and not config.enable_in_reasoning:
            built.params = gate_after_thought(built.params, parsing, prompt["prompt_token_ids"])
        ctx = RequestContext("chatcmpl", req.model, served, built, [prompt], False, "messages", endpoint,
                             fairness_key=_fairness_key(caller), caller=caller,
                             parsing=parsing if parsing.active else None,
                             render=self.render.using(tokenizer))
        return await self._respond(ctx, req, request, caller)

    async def _tokenizer(self, served: ServedModel) -> Any:
        """The tokenizer of ``served``'s requests: the base's, or the adapter's own when it
        adds tokens (read and built in a worker thread the first time)."""
        tokenizers = self.engine.tokenizers
        found = tokenizers.peek(served.lora)
        return found if found is not None else await run_in_threadpool(tokenizers.get, served.lora)

    async def _chat_prompt(self, req: ChatCompletionRequest, served: ServedModel,
                           tools: list[dict] | None, tokenizer: Any) -> dict:
        """The conversation rendered with the caller's template (if trusted), else the
        adapter's own (sandboxed: it is tenant input), else the model's; tokenized with
        ``tokenizer`` (the adapter's own when it adds tokens)."""
        kwargs = {**(req.chat_template_kwargs or {}), **({"tools": tools} if tools else {})}
        prompts = self.prompts.using(tokenizer)
        conversation = prompts.conversation(req)
        add_generation_prompt = bool(req.add_generation_prompt)
        if req.chat_template is not None:  # the caller's own: refused unless trusted
            text = await self.gate.render_template(
                req.chat_template, conversation, tokenizer, add_generation_prompt, kwargs)
            return await prompts.rendered_prompt(text)
        if served.chat_template is not None:  # the adapter's: tenant input, sandboxed
            text = await self.gate.render_adapter_template(
                served.chat_template, conversation, tokenizer, add_generation_prompt, kwargs)
            return await prompts.rendered_prompt(text)
        size = len(json.dumps([m.model_dump() for m in req.messages])) + len(json.dumps(tools or []))
        if size > LONG_PROMPT_CHARS:
            return await run_in_threadpool(prompts.chat_prompt, req, tools)
        return prompts.chat_prompt(req, tools)

    def _check_lengths(self, ctx: RequestContext) -> None:
        """min_tokens must fit in the context (the engine would not stop at max_model_len)."""
        min_tokens = ctx.built.params.min_tokens
        if ctx.built.params.max_tokens is not None:
            return  # min_tokens <= max_tokens, which the engine checks against the context
        for p in ctx.prompts:
            if min_tokens == 0 and len(p["prompt_token_ids"]) >= self.max_model_len:
                raise BadRequest(
                    f"This model's maximum context length is {self.max_model_len} tokens. "
                    f"However, your request has {len(p['prompt_token_ids'])} input tokens. "
                    "Please reduce the length of the input.",
                    param=ctx.prompt_param, code="context_length_exceeded")
            if len(p["prompt_token_ids"]) + min_tokens > self.max_model_len:
                raise BadRequest(
                    f"This model's maximum context length is {self.max_model_len} tokens. However, "
                    f"you requested at least {len(p['prompt_token_ids']) + min_tokens} tokens "
                    f"({len(p['prompt_token_ids'])} in the prompt, min_tokens={min_tokens}).",
                    param="min_tokens", code="context_length_exceeded",
                )

    async def _respond(self, ctx: RequestContext, req, request: Request, caller: Caller) -> Response:
        if not self.engine.is_ready:
            raise ServiceUnavailable("the engine is not running", code="engine_dead")
        self._check_lengths(ctx)
        headers = ctx.built.headers()
        if ctx.served.version is not None:  # which version served (the body keeps the name sent)
            headers[VERSION_HEADER] = str(ctx.served.version)
        # the tenant's quota is held for the request's whole life (the stream's, if streaming)
        quota = contextlib.AsyncExitStack()
        hold = await quota.enter_async_context(self.gate.hold_quota(
            caller, [len(p["prompt_token_ids"]) for p in ctx.prompts], ctx.built.params,
            self.max_model_len,
        ))
        if ctx.fairness_key is not None:  # the tenant's own objectives in the engine's goodput count
            self.engine.set_objectives(ctx.fairness_key, *hold.objectives)
        pump = Pump(self.engine, ctx.prompts, ctx.built.params, ctx.rid, ctx.served, ctx.fairness_key,
                    every_step=bool(req.stream))
        self.metrics.activity.begin(ctx.rid, ctx.served.label, getattr(request.state, "caller", None))

        async def release() -> None:
            hold.charge(_used(pump))
            await quota.aclose()

        try:
            return await self._run(ctx, req, request, pump, headers, release)
        finally:
            if not ctx.handed_off:
                await release()

    async def _run(self, ctx: RequestContext, req, request: Request, pump: Pump, headers,
                   release: Callable[[], Awaitable[None]]) -> Response:
        try:
            if req.stream:
                first = await until_disconnect(self._prime(pump, ctx), request.receive)
                if first is None:
                    pump.cancel()
                    self._record(ctx, pump, "cancelled", error="cancelled")
                    return Response(status_code=499)
                include_usage = bool(req.stream_options and req.stream_options.include_usage)
                continuous = bool(req.stream_options and req.stream_options.continuous_usage_stats)
                ctx.handed_off = True  # the stream releases the quota when it ends
                timing = timing_header(pump.tracks, PHASES[:3])  # decode is still to come
                if timing is not None:
                    headers[TIMING_HEADER] = timing
                return SSEResponse(
                    self._stream(pump, ctx, first, include_usage, continuous, release),
                    headers=headers,
                )
            finals = await until_disconnect(self._collect(pump, ctx), request.receive)
            if finals is None:
                pump.cancel()
                self._record(ctx, pump, "cancelled", error="cancelled")
                return Response(status_code=499)
        except BaseException as exc:
            pump.cancel()
            if isinstance(exc, (asyncio.CancelledError, KeyboardInterrupt, SystemExit)):
                self._record(ctx, pump, "cancelled", error="cancelled")
                raise
            err = to_api_error(exc, self._error_context(ctx))
            self._record(ctx, pump, metric_label(exc), error=err.code or err.type)
            raise err from None
        body = ctx.render.completion_body(ctx, finals) if ctx.kind == "cmpl" else ctx.render.chat_body(ctx, finals)
        self._record(ctx, pump, "ok", usage=body.usage.model_dump())
        timing = timing_header(pump.tracks)
        if timing is not None:
            headers[TIMING_HEADER] = timing
        return JSONResponse(body.model_dump(), headers=headers)

    def _error_context(self, ctx: RequestContext) -> ErrorContext:
        """The server's error context with this request's prompt field."""
        return dataclasses.replace(self.errors, prompt_param=ctx.prompt_param)

    async def _prime(self, pump: Pump, ctx: RequestContext) -> list[tuple[int, RequestOutput | None]]:
        """Wait until every prompt's request was added and produced its first output, so
        that add-time errors become HTTP errors; returns the outputs seen so far."""
        seen: set[int] = set()
        buffered = []
        while len(seen) < len(ctx.prompts):
            i, out = await pump.next()
            buffered.append((i, out))
            seen.add(i)
        return buffered

    async def _collect(self, pump: Pump, ctx: RequestContext) -> list[RequestOutput]:
        finals: list[RequestOutput | None] = [None] * len(ctx.prompts)
        while pump.remaining:
            i, out = await pump.next()
            if out is not None:
                finals[i] = out
        return finals  # type: ignore[return-value]

    def _record(self, ctx: RequestContext, pump: Pump, status: str, *,
                usage: dict[str, int] | None = None, error: str | None = None) -> None:
        """Once per request, when it ends (before the client hears the end): metrics, the
        access log line and the usage record (``usage``: the usage object the client got)."""
        if ctx.recorded:
            return
        ctx.recorded = True
        self.metrics.activity.end(ctx.rid, sum(t.output_tokens for t in pump.tracks))
        label = ctx.served.label
        caller = ctx.caller or Caller()
        tenant = str(caller.tenant_id) if caller.tenant_id is not None else ""
        for t in pump.tracks:
            ttft = (t.first - t.start) if t.first is not None else None
            tpot = None
            if t.first is not None and t.end is not None and t.output_tokens > 1:
                tpot = (t.end - t.first) / (t.output_tokens - 1)
            e2e = (t.end - t.start) if t.end is not None else None
            self.metrics.observe_request(
                label, ctx.endpoint, status, prompt_tokens=t.prompt_tokens,
                generated_tokens=t.output_tokens, ttft=ttft, tpot=tpot, e2e=e2e, tenant=tenant,
            )
            if t.engine is not None:
                m = t.engine
                self.metrics.observe_itl(label, m.inter_token_latencies, m.itl_misses, m.itl_target)
        if ctx.parsing is not None:
            self.metrics.observe_parsing(
                label, ctx.parsing.plan.parser_name,
                tools_called=ctx.tools_called, parse_failed=ctx.parse_failed,
                reasoning_tokens=ctx.reasoning_tokens)
        record = usage_record(
            request_id=ctx.rid, tenant_id=caller.tenant_id, key_prefix=caller.key_prefix,
            adapter=ctx.served.adapter, version=ctx.served.version, endpoint=ctx.endpoint,
            tracks=pump.tracks, usage=usage, error=error)
        if ctx.served.version is not None and ctx.served.tenant_id is not None:
            self.metrics.observe_version(
                ctx.served.tenant_id, ctx.served.name, ctx.served.version, status,
                prompt_tokens=record["prompt_tokens"], cached_tokens=record["cached_tokens"],
                completion_tokens=record["completion_tokens"],
                ttft=_s(record["ttft_ms"]), tpot=_s(record["tpot_ms"]))
        if self.usage is not None:
            self.usage.record(record)
        logger.info(
            "%s %s %s", ctx.endpoint, ctx.model, status,
            extra={
                "id": ctx.rid, "model": ctx.model, "adapter": label, "status": status,
                "version": ctx.served.version,
                "prompt_tokens": record["prompt_tokens"],
                "completion_tokens": record["completion_tokens"],
                "ttft_ms": record["ttft_ms"],
            },
        )

    # --- streaming ----------------------------------------------------------------------
    async def _stream(self, pump: Pump, ctx: RequestContext, first, include_usage: bool,
                      continuous: bool, release: Callable[[], Awaitable[None]]
                      ) -> AsyncIterator[str]:
        state = StreamState(ctx)
        # every chunk shares its head: render it once
        prefix = dumps(ctx.render.head(ctx, stream=True))[:-1] + ',"choices":['
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
                    for choice in ctx.render.chunks(ctx, state, i, out):
                        tail = ""
                        if include_usage:
                            tail = ',"usage":' + (dumps(state.usage()) if continuous else "null")
                        parts.append(f"data: {prefix}{dumps(choice)}]{tail}}}\n\n")
                if parts:
                    yield "".join(parts)
            self._record(ctx, pump, "ok", usage=state.usage())  # before the client hears the end
            if include_usage:
                yield sse({**ctx.render.head(ctx, stream=True), "choices": [],
                           "usage": state.usage()})
            yield sse("[DONE]")
        except (asyncio.CancelledError, GeneratorExit):
            self._record(ctx, pump, "cancelled", error="cancelled")
            raise
        except BaseException as exc:
            err = to_api_error(exc, self._error_context(ctx))
            self._record(ctx, pump, metric_label(exc), error=err.code or err.type)
            yield sse(err.body())
            yield sse("[DONE]")
        finally:
            pump.cancel()
            self._record(ctx, pump, "cancelled", error="cancelled")  # no-op once recorded
            await release()


def _used(pump: Pump) -> int:
    """Prompt + generated tokens of every engine request of the pump (for the quota)."""
    return sum(t.prompt_tokens + t.output_tokens for t in pump.tracks)


def _s(ms: float | None) -> float | None:
    return ms / 1000 if ms is not None else None

