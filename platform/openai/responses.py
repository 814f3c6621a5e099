"""Response bodies and stream chunks of completions and chat completions, built from
the engine's cumulative :class:`RequestOutput` snapshots."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from loramux.engine.outputs import CompletionOutput, RequestOutput
from loramux.platform.identity import Caller
from loramux.platform.openai.chat_output import ChatParsing, ChoiceStream
from loramux.platform.openai.logprobs import TokenRenderer
from loramux.platform.openai.params import BuiltParams
from loramux.platform.openai.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionResponse,
    CompletionChoice,
    CompletionResponse,
    CompletionUsage,
)
from loramux.platform.openai.resolver import ServedModel


class ResponseRenderer(TokenRenderer):
    """Bodies and chunks for one model (tokenizer) and one ``system_fingerprint``."""

    def __init__(self, tokenizer, fingerprint: str) -> None:
        super().__init__(tokenizer)
        self.fingerprint = fingerprint

    def using(self, tokenizer) -> ResponseRenderer:
        """This renderer with ``tokenizer`` (an adapter's own, when it adds tokens)."""
        if tokenizer is self.tokenizer:
            return self
        return ResponseRenderer(tokenizer, self.fingerprint)

    def head(self, ctx: RequestContext, stream: bool) -> dict[str, Any]:
        obj = {
            ("cmpl", False): "text_completion", ("cmpl", True): "text_completion",
            ("chatcmpl", False): "chat.completion", ("chatcmpl", True): "chat.completion.chunk",
        }[(ctx.kind, stream)]
        return {
            "id": ctx.rid, "object": obj, "created": ctx.created, "model": ctx.model,
            "system_fingerprint": self.fingerprint,
        }

    def chunks(self, ctx: RequestContext, state: StreamState, i: int, out: RequestOutput) -> list[dict]:
        """The ``choices`` entries to send for a new snapshot of prompt ``i``."""
        state.prompt_tokens[i] = len(out.prompt_token_ids)
        state.cached_tokens[i] = out.num_cached_tokens
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
                    prompt_text = self.prompt_text(ctx.prompts[i])
                    text = prompt_text + text
                    if lp is not None and out.prompt_logprobs is not None:
                        new_ids = list(out.prompt_token_ids) + new_ids
                        lp = list(out.prompt_logprobs) + lp
                    else:
                        offset += len(prompt_text)
                choice = {
                    "index": index, "text": text,
                    "logprobs": self.completion_logprobs(new_ids, lp, offset) if lp is not None else None,
                    "finish_reason": finish,
                    "stop_reason": o.stop_reason if finish is not None else None,
                }
            elif ctx.parsing is not None:
                chunks += self._parsed_chunks(ctx, state, index, o, first_chunk, finish,
                                              new_ids, lp)
                continue
            else:
                d: dict[str, Any] = {}
                if first_chunk:
                    d["role"] = "assistant"
                if delta or first_chunk:
                    d["content"] = delta
                choice = {
                    "index": index, "delta": d,
                    "logprobs": self.chat_logprobs(new_ids, lp, ctx.built.params.logprobs or 0)
                    if lp is not None else None,
                    "finish_reason": finish,
                    "stop_reason": o.stop_reason if finish is not None else None,
                }
            chunks.append(choice)
        return chunks

    def _parsed_chunks(self, ctx: RequestContext, state: StreamState, index: int,
                       o: CompletionOutput, first_chunk: bool, finish: str | None,
                       new_ids: list[int], lp) -> list[dict]:
        """The chunks of a choice whose text goes through the reasoning / tool parsers:
        one per delta the parsers produced (the first also says ``role``), the logprobs
        on the first, the finish reason on the last."""
        stream = state.streams.get(index)
        if stream is None:
            stream = state.streams[index] = ctx.parsing.stream()
        deltas = stream.step(o.text, o.token_ids)
        if finish is not None:
            deltas += stream.finish()
            state.reasoning_tokens[index] = stream.reasoning_tokens
            ctx.reasoning_tokens += stream.reasoning_tokens
            ctx.tools_called |= stream.called
            ctx.parse_failed |= stream.parse_failed
            finish = ctx.parsing.finish_reason(stream.called, finish)
        if first_chunk:
            deltas = [{"role": "assistant", "content": ""}, *deltas]
        if not deltas and (finish is not None or lp):
            deltas = [{}]
        out = []
        for k, d in enumerate(deltas):
            last = k == len(deltas) - 1
            out.append({
                "index": index, "delta": d,
                "logprobs": self.chat_logprobs(new_ids, lp, ctx.built.params.logprobs or 0)
                if lp and k == 0 else None,
                "finish_reason": finish if last else None,
                "stop_reason": o.stop_reason if finish is not None and last else None,
            })
        return out

    def usage(self, finals: list[RequestOutput]) -> CompletionUsage:
        prompt = sum(len(f.prompt_token_ids) for f in finals)
        completion = sum(len(o.token_ids) for f in finals for o in f.outputs)
        cached = sum(f.num_cached_tokens for f in finals)
        return CompletionUsage(prompt_tokens=prompt, completion_tokens=completion,
                               total_tokens=prompt + completion,
                               prompt_tokens_details={"cached_tokens": cached})

    def completion_body(self, ctx: RequestContext, finals: list[RequestOutput]) -> CompletionResponse:
        choices = []
        n = ctx.built.params.n
        for i, final in enumerate(finals):
            prefix = self.prompt_text(ctx.prompts[i]) if ctx.echo else ""
            for o in final.outputs:
                logprobs = None
                if o.logprobs is not None:
                    if ctx.echo and final.prompt_logprobs is not None:
                        logprobs = self.completion_logprobs(
                            list(final.prompt_token_ids) + o.token_ids,
                            list(final.prompt_logprobs) + o.logprobs, 0)
                    else:
                        logprobs = self.completion_logprobs(o.token_ids, o.logprobs, len(prefix))
                with_prompt = ctx.built.params.prompt_logprobs is not None and not ctx.echo
                choices.append(CompletionChoice(
                    index=i * n + o.index,
                    text=prefix + o.text,
                    logprobs=logprobs,
                    prompt_logprobs=self.prompt_logprobs(final) if with_prompt else None,
                    finish_reason=finish_reason(o),
                    stop_reason=o.stop_reason,
                ))
        choices.sort(key=lambda c: c.index)
        return CompletionResponse(**self.head(ctx, stream=False), choices=choices,
                                  usage=self.usage(finals))

    def chat_body(self, ctx: RequestContext, finals: list[RequestOutput]) -> ChatCompletionResponse:
        final = finals[0]
        choices = []
        reasoning_tokens = 0
        for o in sorted(final.outputs, key=lambda o: o.index):
            message = AssistantMessage(content=o.text)
            reason = finish_reason(o)
            if ctx.parsing is not None:
                parsed = ctx.parsing.message(o.text, o.token_ids)
                message = AssistantMessage(content=parsed.content, reasoning=parsed.reasoning,
                                           tool_calls=parsed.tool_calls)
                reason = ctx.parsing.finish_reason(bool(parsed.tool_calls), reason)
                reasoning_tokens += parsed.reasoning_tokens
                ctx.reasoning_tokens += parsed.reasoning_tokens
                ctx.tools_called |= bool(parsed.tool_calls)
                ctx.parse_failed |= parsed.parse_failed
            choices.append(ChatChoice(
                index=o.index,
                message=message,
                logprobs=self.chat_logprobs(o.token_ids, o.logprobs, ctx.built.params.logprobs or 0)
                if o.logprobs is not None else None,
                finish_reason=reason,
                stop_reason=o.stop_reason,
            ))
        with_prompt = ctx.built.params.prompt_logprobs is not None
        usage = self.usage(finals)
        if ctx.parsing is not None and ctx.parsing.reasoning_cls is not None:
            usage.completion_tokens_details = {"reasoning_tokens": reasoning_tokens}
        return ChatCompletionResponse(
            **self.head(ctx, stream=False), choices=choices, usage=usage,
            prompt_logprobs=self.prompt_logprobs(final) if with_prompt else None,
        )

    def prompt_text(self, prompt: dict) -> str:
        if prompt.get("prompt") is not None:
            return prompt["prompt"]
        return self.tokenizer.decode(prompt["prompt_token_ids"])


def finish_reason(o: CompletionOutput) -> str | None:
    return o.finish_reason if o.finish_reason != "abort" else None


@dataclass
class RequestContext:
    kind: str  # cmpl | chatcmpl
    model: str
    served: ServedModel
    built: BuiltParams
    prompts: list[dict]
    echo: bool
    prompt_param: str
    endpoint: str
    rid: str = ""
    fairness_key: str | None = None
    """The engine's fair-share key: the caller's tenant (None = anonymous callers share one)."""
    caller: Caller | None = None
    """Who sent it (the usage record's tenant and key)."""
    created: int = field(default_factory=lambda: int(time.time()))
    recorded: bool = False
    handed_off: bool = False
    """The response streams: the stream, not the handler, releases the tenant's quota."""
    parsing: ChatParsing | None = None
    """A chat request's reasoning / tool parsing (None: the text is the content)."""
    tools_called: bool = False
    """Some choice answered with tool calls (for the per-adapter counter)."""
    parse_failed: bool = False
    """Some choice's text looked like a call but did not parse (served as content)."""
    reasoning_tokens: int = 0
    render: ResponseRenderer | None = None
    """Its bodies and chunks, with its tokenizer (an adapter's own, when it adds tokens)."""

    def __post_init__(self) -> None:
        self.rid = f"{self.kind}-{uuid.uuid4().hex}"


@dataclass
class StreamState:
    ctx: RequestContext
    sent: dict[int, tuple[int, int]] = field(default_factory=dict)
    prompt_tokens: dict[int, int] = field(default_factory=dict)
    cached_tokens: dict[int, int] = field(default_factory=dict)
    completion_tokens: dict[int, int] = field(default_factory=dict)
    streams: dict[int, ChoiceStream] = field(default_factory=dict)
    """Each parsed choice's parser state."""
    reasoning_tokens: dict[int, int] = field(default_factory=dict)

    def usage(self) -> dict[str, Any]:
        p = sum(self.prompt_tokens.values())
        c = sum(self.completion_tokens.values())
        out: dict[str, Any] = {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
                               "prompt_tokens_details": {"cached_tokens": sum(self.cached_tokens.values())}}
        if self.ctx.parsing is not None and self.ctx.parsing.reasoning_cls is not None:
            out["completion_tokens_details"] = {"reasoning_tokens": sum(self.reasoning_tokens.values())}
        return out
