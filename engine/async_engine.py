"""AsyncEngine: the engine's step loop on a background thread, asyncio in front.

All engine mutations (add, abort, step) happen on the loop thread; callers reach it through
a command queue. ``generate`` is an async iterator of cumulative ``RequestOutput`` snapshots;
leaving it early aborts the request and frees its KV blocks at once.

Failures: an exception inside a step fails only that step's requests (only the culprit when one
request's sampling or detokenizing failed) and the loop goes on. If the loop itself dies (an error
outside a step's model run, e.g. in scheduling), every pending and queued caller gets
:class:`EngineDeadError` at once, :attr:`AsyncEngine.is_ready` turns False, and the engine
**restarts in-process**: its request state (queues, KV cache bookkeeping) is rebuilt, the model
weights and adapter slots are kept, and the loop runs again (``restarts`` counts it). After
``max_restarts`` deaths it stays down, not ready, for a supervisor to replace the process.

Load reports: once someone asked for one (:meth:`AsyncEngine.load_report`), the loop publishes a
:class:`LoadReport` after every step (before its outputs go out) and every idle turn, so readers
get the engine's state without waiting for its thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from loramux.engine import omp_threads
from loramux.engine.block_manager import KVEventListener
from loramux.engine.config import EngineConfig
from loramux.engine.engine import LLMEngine, PromptType
from loramux.engine.errors import AdapterGoneError, EngineDeadError
from loramux.engine.lora.manager import AdapterListener, ResidencySnapshot
from loramux.engine.lora_request import LoRARequest
from loramux.engine.outputs import EngineStats, LoadReport, RequestOutput
from loramux.engine.sampling_params import SamplingParams

SWITCH_INTERVAL_S = 0.001
"""The interpreter's GIL switch interval while an engine thread runs (Python's default is 5 ms):
the HTTP loop shares the GIL with the busy engine thread, and each hand-off between them (a
request in, an output out) waited up to the whole interval, several times per request; at 1 ms
a neighbour's short request beside a flood spends ~25% less time waiting."""

logger = logging.getLogger(__name__)

__all__ = ["AdapterGoneError", "AsyncEngine", "EngineDeadError", "EngineStats"]


class AsyncEngine:
    """Thread-backed asynchronous front of :class:`LLMEngine`.

    The platform uses only the public methods and properties below (requests, stats,
    adapter residency actions, read-only facts about the model); ``engine`` is the
    engine-thread's own object, for the engine's tests and benchmarks."""

    RESIDENCY_INTERVAL = 0.02
    """Seconds a busy loop reuses a load report's residency (it walks every adapter)."""

    def __init__(self, engine: LLMEngine, max_restarts: int = 100) -> None:
        self.engine = engine
        self.max_restarts = max_restarts
        self.restarts = 0
        """Times the loop died and was restarted in-process."""
        self._commands: queue.Queue[tuple[Callable, concurrent.futures.Future]] = queue.Queue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._quiet: dict[str, bool] = {}
        """Requests that want their first and last outputs only -> the first was sent."""
        self._stop = threading.Event()
        self._dead: BaseException | None = None
        self._report: LoadReport | None = None
        self._reports_wanted = False
        self._residency_at = 0.0
        sys.setswitchinterval(SWITCH_INTERVAL_S)
        self._thread = threading.Thread(target=self._loop, name="loramux-engine", daemon=True)
        self._thread.start()
        omp_threads.release_pool()  # the builder's pool would throttle the steps' teams

    # --- public API ----------------------------------------------------------------
    async def generate(
        self,
        prompt: PromptType,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        lora_request: LoRARequest | None = None,
        fairness_key: str | None = None,
        weight: float = 1.0,
        every_step: bool = True,
    ) -> AsyncIterator[RequestOutput]:
        """Yield the request's output after every step it advances; the last is finished.
        ``every_step`` False: only the first output (its first token) and the finished one
        (a caller that answers once: no snapshot per step taken on the engine thread nor
        handled on the event loop). With ``use_beam_search`` only the finished output comes,
        once the search ends. ``fairness_key``/``weight``: see :meth:`LLMEngine.add_request`."""
        request_id = request_id or uuid.uuid4().hex
        if sampling_params is not None and sampling_params.use_beam_search:
            from loramux.engine.beam_search import beam_search_request

            yield await beam_search_request(self, prompt, sampling_params, request_id, lora_request,
                                            fairness_key=fairness_key)
            return
        if sampling_params is not None and sampling_params.structured_outputs is not None:
            # compiled off the engine thread, time-limited; add_request then finds it cached
            await self.engine.prepare_grammar(sampling_params.structured_outputs)
        loop = asyncio.get_running_loop()
        stream: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (loop, stream)
        if not every_step:
            self._quiet[request_id] = False
        try:
            await self.call(lambda: self.engine.add_request(
                request_id, prompt, sampling_params, lora_request, fairness_key, weight))
        except BaseException:
            self._streams.pop(request_id, None)
            raise
        finished = False
        try:
            while True:
                item = await stream.get()
                if isinstance(item, BaseException):
                    raise item
                if item.extra.get("error") is not None:
                    finished = True
                    raise item.extra["error"]
                finished = item.finished
                yield item
                if finished:
                    break
        finally:
            self._streams.pop(request_id, None)
            self._quiet.pop(request_id, None)
            if not finished:
                self._submit(lambda: self.engine.abort_request(request_id))

    async def abort(self, request_id: str) -> bool:
        """Stop a request and free its KV blocks."""
        self._streams.pop(request_id, None)
        return await self.call(lambda: self.engine.abort_request(request_id))

    def fail_waiting(self, lora_key: str, message: str) -> list[str]:
        """Fail at once, with :class:`AdapterGoneError` (``message``), every queued request
        of adapter ``lora_key`` that has not started; running ones finish on the version
        they started with. Called when an adapter is deleted or replaced. Runs on the
        engine thread: call it through :meth:`call` / :meth:`call_sync`. Returns the
        failed request ids."""
        failed = self._deliver(self.engine.abort_waiting(lora_key, AdapterGoneError(message)))
        return [req.request_id for req in failed]

    async def call(self, fn: Callable):
        """Run ``fn()`` on the engine thread (between steps) and return its result."""
        return await asyncio.wrap_future(self._submit(fn))

    def call_sync(self, fn: Callable, timeout: float | None = None):
        """Blocking variant of :meth:`call` for non-async callers."""
        return self._submit(fn).result(timeout)

    async def lora_snapshot(self) -> ResidencySnapshot:
        """The adapters' residency, taken on the engine thread (empty without LoRA)."""
        return await self.call(self.engine.adapter_snapshot)

    def add_adapter_listener(self, listener: AdapterListener) -> Callable[[], None]:
        """Hear ``(event, key)`` for adapter loads, evictions and drops (on the engine
        thread); returns the remover. Without LoRA nothing is ever heard."""
        return self.engine.add_adapter_listener(listener)

    def stats(self) -> EngineStats:
        """The engine's counters (the same :class:`EngineStats` as ``LLMEngine.stats()``)."""
        return self.engine.stats()

    def set_objectives(self, key: str | None, ttft_ms: float | None, itl_ms: float | None) -> None:
        """A fairness key's own goodput objectives (a tenant's quotas; None: the engine's)."""
        self.engine.scheduler.set_objectives(key, ttft_ms, itl_ms)

    def load_report(self) -> LoadReport | None:
        """The latest :class:`LoadReport` the engine thread published; never waits. The
        first call starts the publishing (None until the loop's next turn)."""
        self._reports_wanted = True
        return self._report

    def add_kv_listener(self, listener: KVEventListener) -> Callable[[], None]:
        """Hear the prefix cache's keys stored, evicted and cleared (on the engine thread,
        inside the step: the listener queues and returns). Returns the remover."""
        return self.engine.add_kv_listener(listener)

    # --- adapter residency (each runs on the engine thread, between steps) ------------
    async def register_adapter(self, request: LoRARequest) -> None:
        """Make an adapter known to the engine (its folder is fetched on first load)."""
        await self.call(lambda: self.engine.register_adapter(request))

    async def evict_adapter(self, key: str) -> tuple[bool, bool]:
        """Free the adapter's device slot: ``(done, deferred)``; deferred = it is in use
        and leaves its slot once its running requests finish; done False = not in a slot."""
        return await self.call(lambda: self.engine.evict_adapter(key))

    async def pin_adapter(self, key: str) -> None:
        """Keep the adapter resident (never evicted); starts its load."""
        await self.call(lambda: self.engine.pin_adapter(key))

    async def unpin_adapter(self, key: str) -> None:
        """Let the adapter be evicted again."""
        await self.call(lambda: self.engine.unpin_adapter(key))

    async def warm_adapter(self, key: str, timeout: float = 30.0) -> bool:
        """Load the adapter (in the background) and place it in a device slot; True once
        it sits there, False when no slot came free within ``timeout`` seconds (it stays
        in CPU memory). Asks the engine in short calls, so steps go on meanwhile."""
        deadline = time.monotonic() + timeout
        while True:
            placed = await self.call(lambda: self.engine.warm_adapter(key))
            if placed is not None:
                return placed
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(0.02)

    def drop_adapter(self, key: str, message: str, timeout: float = 30.0) -> list[str]:
        """Blocking: a deleted or replaced adapter version leaves the engine. Its queued
        requests fail now with :class:`AdapterGoneError` (``message``), running ones
        finish on the weights they started with, then its weights are dropped. Returns
        the failed request ids; nothing happens on an engine that is not ready."""
        if not self.is_ready:
            return []

        def drop() -> list[str]:
            failed = self._deliver(self.engine.drop_adapter(key, AdapterGoneError(message)))
            return [req.request_id for req in failed]
        return self.call_sync(drop, timeout=timeout)

    # --- read-only facts -------------------------------------------------------------
    @property
    def config(self) -> EngineConfig:
        return self.engine.config

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def tokenizers(self) -> Any:
        """Each adapter's tokenizer: the base's, or its own when it adds tokens
        (:class:`~loramux.engine.adapter_tokenizers.AdapterTokenizers`)."""
        return self.engine.detokenizer.tokenizers

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def model_path(self) -> Path:
        """The base model's folder."""
        return Path(self.engine.model_path)

    @property
    def dtype(self) -> str:
        """The model's dtype (``float32``, ``bfloat16``, ``float16``)."""
        return str(self.engine.model.dtype).removeprefix("torch.")

    @property
    def weight_format(self) -> str:
        """How the base's projections are stored: ``float`` or the quantization's description."""
        quant = self.engine.model.quant
        return quant.describe() if quant.quantized else "float"

    @property
    def weight_bytes(self) -> int:  # the base's weights' bytes (quantized ones as stored)
        return int(self.engine.model.weight_bytes())

    @property
    def device(self) -> str:
        """The device the model runs on (``cpu``, ``cuda:0``)."""
        return str(self.engine.model.device)

    @property
    def lora_enabled(self) -> bool:
        return self.engine.lora_enabled

    @property
    def is_ready(self) -> bool:
        """True while the loop runs and takes requests (False after shutdown, while a dead
        loop restarts, and for good once it gave up); ``/ready`` reports it."""
        return self._thread.is_alive() and self._dead is None and not self._stop.is_set()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the loop; later calls, commands still queued and open streams fail with
        EngineDeadError."""
        self._stop.set()
        self._commands.put((lambda: None, concurrent.futures.Future()))
        self._thread.join(timeout)
        if self._dead is None:
            self._dead = RuntimeError("the engine was shut down")
        self._fail_everyone(EngineDeadError("the engine was shut down"))

    # --- the loop --------------------------------------------------------------------
    def _submit(self, fn: Callable) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        if self._dead is not None:
            fut.set_exception(EngineDeadError(f"the engine stopped: {self._dead!r}"))
            return fut
        self._commands.put((fn, fut))
        return fut

    def _drain_commands(self, block: bool) -> None:
        try:
            fn, fut = self._commands.get(timeout=0.05) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn())
                except BaseException as exc:  # handed to the caller
                    fut.set_exception(exc)
            try:
                fn, fut = self._commands.get_nowait()
            except queue.Empty:
                return

    def _deliver(self, reqs) -> list:
        """Send each request's snapshot to its caller's stream (engine thread)."""
        for req in reqs:
            target = self._streams.get(req.request_id)
            if target is None:
                continue
            sent_first = self._quiet.get(req.request_id)
            if sent_first is not None:
                if sent_first and not req.finished:
                    continue  # a quiet request between its first and last outputs
                self._quiet[req.request_id] = True
            loop, stream = target
            try:
                loop.call_soon_threadsafe(stream.put_nowait, req.to_output(streaming=True))
            except RuntimeError:  # the caller's event loop is gone: nobody listens
                self._streams.pop(req.request_id, None)
                self.engine.abort_request(req.request_id)
        return reqs

    def _loop(self) -> None:
        while True:
            try:
                self._run()
                return
            except BaseException as exc:
                logger.exception("engine loop died")
                self._dead = exc
                self._fail_everyone(EngineDeadError(f"the engine stopped: {exc!r}; retry shortly"))
            if self._stop.is_set() or self.restarts >= self.max_restarts:
                return
            try:
                self.engine.reset()
            except BaseException:
                logger.exception("engine restart failed; it stays down")
                return
            self.restarts += 1
            logger.warning("engine loop restarted in-process (%d restarts)", self.restarts)
            self._dead = None

    def _run(self) -> None:
        engine = self.engine
        while not self._stop.is_set():
            self._drain_commands(block=not engine.has_unfinished_requests())
            if not engine.has_unfinished_requests():
                engine.poll_adapters()
                self._publish_report(busy=False)
                continue
            done = engine.step_requests()
            self._publish_report(busy=True)
            self._deliver(done)

    def _publish_report(self, busy: bool) -> None:
        """A fresh :class:`LoadReport` for readers (engine thread); while busy the residency
        is reused for ``RESIDENCY_INTERVAL`` seconds."""
        if not self._reports_wanted:
            return
        last, now = self._report, time.monotonic()
        if last is None or not busy or now - self._residency_at >= self.RESIDENCY_INTERVAL:
            self._report = self.engine.load_report()
            self._residency_at = now
        else:
            self._report = self.engine.load_report(last.residency)

    def _fail_everyone(self, error: EngineDeadError) -> None:
        """Every caller waiting on a stream or a queued command hears ``error`` now."""
        streams, self._streams = list(self._streams.values()), {}
        for loop, stream in streams:
            try:
                loop.call_soon_threadsafe(stream.put_nowait, error)
            except RuntimeError:
                pass
        while True:
            try:
                _, fut = self._commands.get_nowait()
            except queue.Empty:
                return
            if fut.set_running_or_notify_cancel():
                fut.set_exception(error)
