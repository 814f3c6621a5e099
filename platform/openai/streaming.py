"""Moving engine outputs to the client: one task per prompt feeding one queue
(:class:`Pump`), server-sent events, and the one disconnect watcher
(:func:`wait_disconnect`) that both the streaming and the JSON paths use, so a client
that goes away cancels its engine requests at once."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from loramux.engine.async_engine import AsyncEngine
from loramux.engine.outputs import RequestMetrics, RequestOutput
from loramux.engine.sampling_params import SamplingParams
from loramux.platform.openai.resolver import ServedModel

logger = logging.getLogger(__name__)


async def wait_disconnect(receive: Receive) -> None:
    """Return when the client has gone away."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def until_disconnect(coro, receive: Receive):
    """Run ``coro``; None when the client went away first (the work is cancelled)."""
    work = asyncio.ensure_future(coro)
    watcher = asyncio.ensure_future(wait_disconnect(receive))
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


class SSEResponse(StreamingResponse):
    """Server-sent events that always watch for the client going away, so a disconnect
    cancels the stream (and with it the engine requests) even between two events."""

    media_type = "text/event-stream"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        stream = asyncio.ensure_future(self.stream_response(send))
        watcher = asyncio.ensure_future(wait_disconnect(receive))
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


def dumps(data: Any) -> str:
    return json.dumps(data, ensure_ascii=False, separators=(",", ":"))


def sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else dumps(data)}\n\n"


@dataclass
class Track:
    """Timing and counts of one engine request, for metrics, logs and usage records."""

    start: float = field(default_factory=time.monotonic)
    first: float | None = None
    end: float | None = None
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    """Prompt tokens served from the prefix cache."""
    finish_reason: str | None = None
    """The first completion's, once finished."""
    engine: RequestMetrics | None = None
    """The engine's timestamps and token gaps of the request (complete once it finished)."""

    def update(self, out: RequestOutput) -> None:
        self.engine = out.metrics
        self.prompt_tokens = len(out.prompt_token_ids)
        self.cached_tokens = out.num_cached_tokens
        n = sum(len(o.token_ids) for o in out.outputs)
        if n and self.first is None:
            self.first = time.monotonic()
        self.output_tokens = n
        if out.finished:
            self.end = time.monotonic()
            self.finish_reason = out.outputs[0].finish_reason if out.outputs else None


class Pump:
    """Runs one engine request per prompt as a task each, feeding one queue."""

    def __init__(self, engine: AsyncEngine, prompts: list, params: SamplingParams, rid: str,
                 served: ServedModel, fairness_key: str | None = None, every_step: bool = True) -> None:
        """``every_step`` False (a response sent once, not streamed): the engine hands over
        each request's first and last outputs only."""
        self.fairness_key = fairness_key
        self.every_step = every_step
        self.queue: asyncio.Queue = asyncio.Queue()
        self.tracks = [Track() for _ in prompts]
        self.tasks = [
            asyncio.ensure_future(self._run(engine, i, p, params, f"{rid}-{i}", served))
            for i, p in enumerate(prompts)
        ]
        self.remaining = len(prompts)

    async def _run(self, engine, i, prompt, params, rid, served) -> None:
        try:
            async for out in engine.generate(prompt, params, request_id=rid, lora_request=served.lora,
                                             fairness_key=self.fairness_key,
                                             every_step=self.every_step):
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
