"""LLMEngine: the synchronous core. A step is four phases, each handing plain data to the
next (vLLM v1's shape)::

    schedule() -> SchedulerOutput -> execute -> ModelOutput -> sample -> SampledOutput
               -> update_from_output -> StepOutcome -> settle (the requests' side)

then the requests that advanced go back to the caller. Only the execute and sample phases
hold tensors; only the scheduler changes a sequence's status.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import torch

from loramux.engine.block_manager import KVCacheManager, KVEventListener
from loramux.engine.config import EngineConfig
from loramux.engine.detokenizer import Detokenizer
from loramux.engine.distributed.driver import make_runner
from loramux.engine.errors import (
    AdapterNumericsError,
    ContextLengthError,
    EngineStepError,
    QueueFullError,
)
from loramux.engine.intake import (
    PromptType,
    check_prompt,
    lora_start,
    make_sequences,
    prefix_cache_id,
    queue_full_for,
    tokenize,
)
from loramux.engine.loading import load_base
from loramux.engine.lora.manager import LoRAManager
from loramux.engine.lora.null import NoLoRA
from loramux.engine.lora.state import AdapterListener, ResidencySnapshot
from loramux.engine.lora_request import LoRARequest
from loramux.engine.model.kernels.loader import status as kernel_status
from loramux.engine.output_processor import OutputProcessor
from loramux.engine.outputs import EngineStats, LoadReport, RequestOutput
from loramux.engine.postprocess import Postprocessor
from loramux.engine.request import Request
from loramux.engine.runner import plan_num_blocks
from loramux.engine.sampler import Sampler
from loramux.engine.sampling_params import SamplingParams
from loramux.engine.scheduler import Scheduler
from loramux.engine.sequence import SequenceStatus
from loramux.engine.spec_decode.drafter import Drafter
from loramux.engine.step_data import SchedulerOutput, StepOutcome
from loramux.engine.structured_output import StructuredOutputManager
from loramux.engine.structured_params import StructuredOutputsParams

__all__ = ["AdapterNumericsError", "ContextLengthError", "EngineStepError", "LLMEngine", "PromptType", "QueueFullError"]

logger = logging.getLogger(__name__)

AdapterSource = Callable[[str], str | Path]


class LLMEngine:
    """Owns the model, KV cache, scheduler, sampler and (optionally) LoRA slots."""

    def __init__(self, config: EngineConfig, adapter_source: AdapterSource | None = None) -> None:
        self.config = config
        base = load_base(config.model, config.parallel)
        self.model_path, self.device, self.model = base.path, base.device, base.model
        self.tokenizer, self.eos_token_ids = base.tokenizer, base.eos_token_ids
        dims = self.model.dims
        self.max_model_len = base.max_model_len(config.model.max_model_len)
        cc, sc = config.cache, config.scheduler
        # adapter slots first: on a GPU the KV cache gets the memory they leave
        self.lora_manager: LoRAManager | NoLoRA = NoLoRA()
        if config.lora is not None:
            self.lora_manager = LoRAManager(config.lora, self.model, adapter_source,
                                            gpu_utilization=cc.gpu_memory_utilization)
        num_blocks = plan_num_blocks(self.model, cc, self.max_model_len, sc.max_num_seqs)
        self.kv = KVCacheManager(num_blocks, cc.block_size, cc.enable_prefix_caching)
        self.runner = make_runner(self.model, num_blocks, config, self.lora_manager, base.path)
        self.detokenizer = Detokenizer(self.tokenizer, adapter_source, dims.vocab_size)
        self.sampler = Sampler(dims.vocab_size, self.eos_token_ids,
                               torch.Generator().manual_seed(config.model.seed))
        so = config.structured
        self.structured = StructuredOutputManager(
            self.tokenizer, dims.vocab_size, so.grammar_cache_size, so.grammar_compile_timeout
        )
        self.postprocessor = Postprocessor(self.detokenizer, self.eos_token_ids, self.max_model_len)
        self.output_processor = OutputProcessor(
            self.sampler, self.postprocessor, self.structured, self.lora_manager)
        self.scheduler = self._make_scheduler()
        self.requests: dict[str, Request] = {}
        self.num_steps = 0
        """Steps that ran a plan since start (``EngineStats.num_steps``)."""
        self._cycle: tuple[SchedulerOutput, float, int] | None = None
        """The last step (plan, start, forks) until its cycle ends: see :meth:`_end_cycle`."""
        self._awaiting_adapter: dict[str, Request] = {}
        """Requests whose adapter was not in a slot yet (their adapter-load wait runs)."""
        logger.info(
            "engine ready: %s (%s, %s), %d KV blocks of %d tokens, max_model_len %d",
            self.model_path.name, base.dtype, self.device, num_blocks, cc.block_size,
            self.max_model_len,
        )

    def _make_scheduler(self) -> Scheduler:
        spec = self.config.speculative
        drafter = Drafter(spec, self.max_model_len) if spec is not None else None
        return Scheduler(self.config.scheduler, self.kv, self.max_model_len, self.lora_manager,
                         drafter=drafter)

    # --- requests -------------------------------------------------------------------
    def tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """(prompt text, token ids) of a string, ``{"prompt_token_ids": [...]}`` or ``{"prompt": ...}``."""
        return tokenize(self.tokenizer, prompt)

    def add_request(
        self,
        request_id: str | None,
        prompt: PromptType,
        params: SamplingParams | None = None,
        lora_request: LoRARequest | None = None,
        fairness_key: str | None = None,
        weight: float = 1.0,
    ) -> Request:
        """Validate and queue a request; raises :class:`PromptError`, :class:`ContextLengthError`,
        :class:`SamplingParamError`, :class:`LoRAError` (bad input) or :class:`QueueFullError`.
        ``fairness_key`` (opaque: the platform's tenant) and ``weight`` place it in the fair
        share of ``SchedulerConfig.fairness_policy``; requests without a key share one."""
        params = params or SamplingParams()
        if not weight > 0:
            raise ValueError(f"weight must be positive, got {weight}")
        request_id = request_id or uuid.uuid4().hex
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already running")
        tok = self.detokenizer.tokenizers.get(lora_request)  # the adapter's own, if it adds tokens
        text, ids = tokenize(tok, prompt)
        check_prompt(ids, params, self.model.dims.vocab_size, self.max_model_len)
        lora_key, start = None, 0
        if lora_request is not None:
            self.lora_manager.register(lora_request)
            lora_key = lora_request.key
            start = lora_start(ids, self.lora_manager.invocation_tokens(lora_key))
        sc = self.config.scheduler
        if sc.max_waiting is not None and queue_full_for(self.scheduler.waiting, fairness_key,
                                                         sc.max_waiting):
            raise QueueFullError(f"the waiting queue is full ({sc.max_waiting} requests)")
        salt = self.model.prefix_cache_salt(len(ids))
        cache_id = prefix_cache_id(lora_request.prefix_cache_id if lora_request is not None else None, salt)
        seqs = make_sequences(request_id, ids, params, lora_key, cache_id, fairness_key, weight,
                              self.structured.matcher, start, prefix_cache_id(None, salt), tok)
        req = Request(request_id, text, ids, params, seqs, lora_request)
        if lora_key is None or self.lora_manager.is_resident(lora_key):
            req.metrics.adapter_ready_time = req.metrics.arrival_time
        else:
            self._awaiting_adapter[request_id] = req
        self.scheduler.add(seqs[0])  # one prefill: the siblings fork from it (pending_forks)
        self.requests[request_id] = req
        return req

    def abort_request(self, request_id: str) -> bool:
        """Stop a request now and free its KV blocks; False when it is unknown."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return False
        req.aborted = True
        for seq in req.seqs:
            if not seq.is_finished:
                seq.finish_reason = "abort"
                self.scheduler.finish(seq)
        self._end_cycle_if_idle()
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # --- the step -------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one engine step; returns an output for every request that advanced."""
        return [r.to_output() for r in self.step_requests()]

    def step_requests(self) -> list[Request]:
        """Like ``step`` but returns the Request records (the async engine snapshots them)."""
        started = time.monotonic()  # the cycle's start and the rows' first-scheduled time
        self._end_cycle(started)
        failed = self._adapter_events()
        plan = self.scheduler.schedule()
        if plan.is_empty:
            self.lora_manager.poll(wait=0.005)
            return failed
        output = self.runner.execute(plan)
        sampled = self.output_processor.sample(output, self.scheduler.seqs)
        outcome = self.scheduler.update_from_output(plan, sampled)
        done = self._settle(plan, outcome, started)
        seen = {r.request_id for r in done}
        return [*(r for r in failed if r.request_id not in seen), *done]

    def _adapter_events(self) -> list[Request]:
        """One pass before each step over what the adapters did since the last: the requests
        of adapters that failed to load or were marked broken end (the error attached), and
        those whose adapter reached a slot (or that were scheduled) get their adapter-ready
        time. Returns the ended requests."""
        broken = self.lora_manager.failed()
        if not broken and not self._awaiting_adapter:
            return []
        now = time.monotonic()
        ended = []
        for req in list(self.requests.values() if broken else self._awaiting_adapter.values()):
            key = req.lora_request.key if req.lora_request is not None else None
            if key in broken:
                req.error = broken[key]
                self.abort_request(req.request_id)
                ended.append(req)
            elif req.request_id in self._awaiting_adapter and (
                    self.lora_manager.is_resident(key) or req.metrics.first_scheduled_time is not None):
                req.metrics.adapter_ready_time = now
                del self._awaiting_adapter[req.request_id]
        for rid in [rid for rid, req in self._awaiting_adapter.items() if req.finished]:
            del self._awaiting_adapter[rid]
        return ended

    def _settle(self, plan: SchedulerOutput, outcome: StepOutcome, started: float) -> list[Request]:
        """The requests' side of a step: failed ones end (error attached), timestamps and
        inter-token latencies, and finished ones leave the table. Returns the requests that
        changed."""
        self.num_steps += 1
        for row in plan.scheduled:
            req = self.requests.get(row.request_id)
            if req is not None and req.metrics.first_scheduled_time is None:
                req.metrics.first_scheduled_time = started
        touched = {rid: self.requests[rid] for rid in outcome.advanced if rid in self.requests}
        for req in self.fail_requests(outcome.failed):
            touched[req.request_id] = req
        now = time.monotonic()
        target = self.scheduler.itl_target()
        for req in touched.values():
            req.metrics.record_token(now, target)
            if req.finished:
                req.metrics.finished_time = now
                self.requests.pop(req.request_id, None)
        if outcome.error is None:  # a failed batch is no measure of a step's cost
            self._cycle = (plan, started, outcome.num_forks)
        self._end_cycle_if_idle()
        return list(touched.values())

    def _end_cycle(self, now: float) -> None:
        """Feed the step budget the last step's whole cycle: from its planning to the start of
        the next step (outputs delivered, commands run), the gap a decode row sees between two
        tokens; a step after which the engine had nothing left is measured to its own end."""
        if self._cycle is None:
            return
        plan, started, forks = self._cycle
        self._cycle = None
        self.scheduler.observe_step(plan, now - started, extra_rows=forks)

    def _end_cycle_if_idle(self) -> None:
        """The engine went idle (its last request settled or was aborted): the cycle ends now."""
        if not self.requests:
            self._end_cycle(time.monotonic())

    def fail_requests(self, culprits: dict[str, Exception]) -> list[Request]:
        """End these requests (their blocks freed): an :class:`EngineStepError` as it is,
        anything else wrapped in one that names no internals."""
        out = []
        for rid, exc in culprits.items():
            req = self.requests.get(rid)
            if req is None:
                continue
            logger.warning("request %s failed in an engine step: %r", rid, exc)
            req.error = exc if isinstance(exc, EngineStepError) else EngineStepError(
                f"the request failed in the engine ({type(exc).__name__}); other requests "
                f"are not affected, retry it or change its parameters"
            )
            self.abort_request(rid)
            out.append(req)
        return out

    # --- adapters and grammars (AsyncEngine hands each call to the engine thread) -----------
    @property
    def lora_enabled(self) -> bool:
        return self.lora_manager.enabled

    def poll_adapters(self) -> None:
        """Apply finished background loads and pending evictions (idle turns of the loop)."""
        self.lora_manager.poll()

    def register_adapter(self, request: LoRARequest) -> None:
        """Make an adapter known (its config checked; weights fetched on first load)."""
        self.lora_manager.register(request)

    def evict_adapter(self, key: str) -> tuple[bool, bool]:
        """Free the adapter's device slot: ``(done, deferred)``; deferred = it is in use and
        leaves its slot once its running requests finish; done False = not in a slot."""
        freed = self.lora_manager.evict(key)
        return freed, freed and self.lora_manager.is_evict_pending(key)

    def pin_adapter(self, key: str) -> None:
        """Keep the adapter resident (never evicted); starts its load."""
        self.lora_manager.pin(key)

    def unpin_adapter(self, key: str) -> None:
        """Let the adapter be evicted again."""
        self.lora_manager.unpin(key)

    def warm_adapter(self, key: str) -> bool | None:
        """Bring the adapter into a device slot: True once it sits there, None while its load
        runs (ask again), False when every slot is busy or pinned."""
        if self.lora_manager.warm(key):
            return True
        return None if self.lora_manager.is_loading(key) else False

    def drop_adapter(self, key: str, error: Exception) -> list[Request]:
        """A deleted or replaced adapter version leaves: its queued requests fail now with
        ``error`` (running ones finish on the weights they started with), then its weights
        are dropped. Returns the failed requests."""
        failed = self.abort_waiting(key, error)
        self.lora_manager.drop(key)
        return failed

    def adapter_snapshot(self) -> ResidencySnapshot:
        """The adapters' residency as plain data (empty without LoRA)."""
        return self.lora_manager.snapshot()

    def add_adapter_listener(self, listener: AdapterListener) -> Callable[[], None]:
        """Hear ``(event, key)`` for adapter loads, evictions, drops and broken marks (on the
        engine thread); returns the remover. Without LoRA nothing is ever heard."""
        return self.lora_manager.add_listener(listener)

    async def prepare_grammar(self, spec: StructuredOutputsParams) -> None:
        """Compile a request's grammar before it is added (any thread: compiled off the engine
        thread with a time limit; ``add_request`` then finds it cached)."""
        await self.structured.prepare(spec)

    def abort_waiting(self, lora_key: str, error: Exception) -> list[Request]:
        """Fail at once, with ``error``, every request of adapter ``lora_key`` that waits in
        the queue and has not started (running ones finish on the adapter they started
        with). Called on the engine thread when an adapter is deleted or replaced."""
        out = []
        for req in list(self.requests.values()):
            lr = req.lora_request
            if lr is None or lr.key != lora_key:
                continue
            if all(s.status is SequenceStatus.WAITING and s.num_output_tokens == 0 for s in req.seqs):
                req.error = error
                self.abort_request(req.request_id)
                out.append(req)
        return out

    def reset(self) -> None:
        """Drop every request and rebuild the KV cache bookkeeping and the scheduler (their
        state is suspect after the loop died); the model weights and adapters stay."""
        for req in self.requests.values():
            req.aborted = True
        self.requests.clear()
        cc = self.config.cache
        self.kv = KVCacheManager(self.kv.pool.num_blocks, cc.block_size, cc.enable_prefix_caching,
                                 listeners=self.kv.listeners)  # they hear all_blocks_cleared
        self.scheduler = self._make_scheduler()
        self._cycle = None
        self._awaiting_adapter.clear()
        self.runner.reset()  # tensor parallelism: new workers

    def stats(self) -> EngineStats:
        """Counters for the platform's metrics: queue lengths, KV usage, preemptions and the
        prefix cache's lookups (in blocks), hits, hit rate and evictions. Cheap; call any time."""
        pc = self.kv.stats
        kernels = kernel_status()
        return EngineStats(
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            kv_cache_usage=self.kv.usage, num_preemptions=self.scheduler.num_preemptions,
            prefix_cache_hit_rate=pc.hit_rate, prefix_cache_queries=pc.queries,
            prefix_cache_hits=pc.hits, prefix_cache_evictions=self.kv.pool.evictions,
            cpu_kernels=kernels.state, cpu_kernels_reason=kernels.reason, num_steps=self.num_steps,
            spec_decode=drafter.snapshot() if (drafter := self.scheduler.drafter) else {},
        )

    def add_kv_listener(self, listener: KVEventListener) -> Callable[[], None]:
        """Hear the prefix cache's keys change (:class:`KVEventListener`, on the engine
        thread, inside the step; it survives a restart and hears the cleared cache then).
        Returns the function that removes it."""
        return self.kv.add_listener(listener)

    def load_report(self, residency: ResidencySnapshot | None = None) -> LoadReport:
        """What a load-aware router reads of this engine: the counters, the adapters of the
        running and waiting sequences, the residency (``residency``, else taken now) and
        the KV cache's shape. Call on the engine thread (it walks the queues)."""
        running = Counter(s.lora_key for s in self.scheduler.running if s.lora_key is not None)
        waiting = Counter(s.lora_key for s in self.scheduler.waiting if s.lora_key is not None)
        return LoadReport(
            self.stats(), dict(running), dict(waiting),
            residency if residency is not None else self.lora_manager.snapshot(),
            num_kv_blocks=self.kv.pool.num_blocks, block_size=self.kv.block_size,
            taken_at=time.time(),
        )
