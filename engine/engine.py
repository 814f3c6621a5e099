"""LLMEngine: the synchronous core. ``step()`` = schedule → run → postprocess."""

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
from loramux.engine.errors import (
    AdapterNumericsError,
    ContextLengthError,
    EngineStepError,
    PromptError,
    QueueFullError,
)

__all__ = ["AdapterNumericsError", "ContextLengthError", "EngineStepError", "LLMEngine", "QueueFullError"]
from loramux.engine.lora.manager import LoRAManager
from loramux.engine.lora.null import NoLoRA
from loramux.engine.lora.state import ResidencySnapshot
from loramux.engine.lora_request import LoRARequest
from loramux.engine.model.kernels.loader import status as kernel_status
from loramux.engine.model.registry import load_model
from loramux.engine.output_processor import OutputProcessor
from loramux.engine.outputs import EngineStats, LoadReport, RequestOutput
from loramux.engine.postprocess import Postprocessor
from loramux.engine.request import Request
from loramux.engine.runner import ModelRunner, plan_num_blocks
from loramux.engine.sampler import Sampler
from loramux.engine.sampling_params import SamplingParams
from loramux.engine.scheduler import Scheduler
from loramux.engine.sequence import Sequence, SequenceStatus
from loramux.engine.spec_decode.drafter import Drafter
from loramux.engine.step_data import ModelOutput, SchedulerOutput, StepOutcome
from loramux.engine.structured_output import StructuredOutputManager

logger = logging.getLogger(__name__)

PromptType = str | dict | list[int]
AdapterSource = Callable[[str], str | Path]


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def _cpu_has_fast_bf16() -> bool:
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def resolve_dtype(name: str, device: torch.device, model_path: Path) -> torch.dtype:
    """``auto``: the checkpoint's dtype, except bfloat16 where it is much faster (CUDA, and
    CPUs with native bf16 matmuls, as vLLM's CPU backend does) and never float16 on a CPU."""
    if name == "auto":
        from transformers import AutoConfig

        cfg_dtype = getattr(AutoConfig.from_pretrained(model_path), "dtype", None)
        name = str(cfg_dtype).replace("torch.", "") if cfg_dtype is not None else "float32"
        if device.type == "cpu" and (
            name == "float16" or (name == "float32" and _cpu_has_fast_bf16())
        ):
            name = "bfloat16"
        if device.type == "cuda" and name == "float32":
            name = "bfloat16"
    dtype = getattr(torch, name)
    if device.type == "cpu" and dtype == torch.float16:
        raise ValueError("float16 is not supported on the CPU (it is very slow there); use bfloat16 or float32")
    return dtype


def _prefix_cache_id(adapter: str | None, salt: str | None) -> str | None:
    """A sequence's prefix-cache identity: its adapter's, and what the model says sets its
    keys apart (``DecoderModel.prefix_cache_salt``)."""
    if salt is None:
        return adapter
    return f"{adapter or ''}#{salt}"


class LLMEngine:
    """Owns the model, KV cache, scheduler, sampler and (optionally) LoRA slots."""

    def __init__(self, config: EngineConfig, adapter_source: AdapterSource | None = None) -> None:
        from transformers import AutoTokenizer

        self.config = config
        mc = config.model
        if mc.model is None:
            from loramux.engine.default_model import default_model_path

            model_path = default_model_path()
        else:
            model_path = Path(mc.model).expanduser()
            if not model_path.is_dir():
                raise ValueError(f"model {mc.model!r} is not a local folder")
        self.model_path = model_path
        self.device = resolve_device(mc.device)
        dtype = resolve_dtype(mc.dtype, self.device, model_path)
        self.model = load_model(model_path, dtype, self.device, enforce_eager=mc.enforce_eager)
        self.tokenizer = AutoTokenizer.from_pretrained(mc.tokenizer or model_path)
        dims = self.model.dims
        self.max_model_len = mc.max_model_len or dims.max_position_embeddings
        if self.max_model_len > dims.max_position_embeddings:
            raise ValueError(
                f"max_model_len {self.max_model_len} exceeds the model's "
                f"max_position_embeddings {dims.max_position_embeddings}"
            )
        cc, sc = config.cache, config.scheduler
        # adapter slots first: on a GPU the KV cache gets the memory they leave
        self.lora_manager: LoRAManager | NoLoRA = NoLoRA()
        if config.lora is not None:
            self.lora_manager = LoRAManager(
                config.lora, self.model, adapter_source, running_keys=self._running_lora_keys,
                gpu_utilization=cc.gpu_memory_utilization,
            )
        self.model.lora = self.lora_manager.hook
        num_blocks = plan_num_blocks(self.model, cc, self.max_model_len, sc.max_num_seqs)
        self.kv = KVCacheManager(num_blocks, cc.block_size, cc.enable_prefix_caching)
        self.runner = ModelRunner(self.model, num_blocks, cc.block_size, mc.attention_backend)
        self.generator = torch.Generator().manual_seed(mc.seed)
        self.eos_token_ids = self._eos_ids()
        self.detokenizer = Detokenizer(self.tokenizer)
        self.sampler = Sampler(dims.vocab_size, self.eos_token_ids, self.generator)
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
        self._awaiting_adapter: dict[str, Request] = {}
        """Requests whose adapter was not in a slot yet (their adapter-load wait runs)."""
        """The last step, until its cycle ends (plan, start, forks): see _observe_cycle."""
        logger.info(
            "engine ready: %s (%s, %s), %d KV blocks of %d tokens, max_model_len %d",
            model_path.name, dtype, self.device, num_blocks, cc.block_size, self.max_model_len,
        )

    def _make_scheduler(self) -> Scheduler:
        spec = self.config.speculative
        drafter = Drafter(spec, self.max_model_len) if spec is not None else None
        return Scheduler(self.config.scheduler, self.kv, self.max_model_len, self.lora_manager,
                         outputs=self.output_processor, drafter=drafter)

    def _running_lora_keys(self) -> set[str]:
        return {s.lora_key for s in self.scheduler.running if s.lora_key is not None}

    def _eos_ids(self) -> set[int]:
        ids = set()
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        gen_cfg = self.model_path / "generation_config.json"
        if gen_cfg.is_file():
            import json

            eos = json.loads(gen_cfg.read_text()).get("eos_token_id")
            ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        return ids

    # --- requests -------------------------------------------------------------------
    def tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """(prompt text, token ids) of a string, ``{"prompt_token_ids": [...]}`` or ``{"prompt": ...}``."""
        if isinstance(prompt, str):
            return prompt, self.tokenizer(prompt).input_ids
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                return self.tokenize(prompt["prompt"])
            raise PromptError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return None, list(prompt)
        raise PromptError(f"unsupported prompt type {type(prompt).__name__}")

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
        text, ids = self.tokenize(prompt)
        if not ids:
            raise PromptError("the prompt is empty")
        vocab = self.model.dims.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:
            raise PromptError(f"prompt token ids must be in [0, {vocab})")
        params.verify_vocab(vocab)
        if len(ids) >= self.max_model_len:
            raise ContextLengthError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"your prompt has {len(ids)} tokens, leaving no room for output. Please reduce "
                f"the length of the prompt.", "prompt"
            )
        if params.max_tokens is not None and len(ids) + params.max_tokens > self.max_model_len:
            raise ContextLengthError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"you requested {len(ids) + params.max_tokens} tokens ({len(ids)} in the prompt, "
                f"{params.max_tokens} for the completion). Please reduce the length of the "
                f"prompt or max_tokens.", "max_tokens"
            )
        lora_key = None
        if lora_request is not None:
            self.lora_manager.register(lora_request)
            lora_key = lora_request.key
        sc = self.config.scheduler
        if sc.max_waiting is not None and self._queue_full_for(fairness_key, sc.max_waiting):
            raise QueueFullError(f"the waiting queue is full ({sc.max_waiting} requests)")
        seqs = []
        for i in range(params.best_of):
            seq = Sequence(request_id, i, ids, params, lora_key, fairness_key=fairness_key,
                           fairness_weight=weight)
            seq.adapter_id = _prefix_cache_id(
                lora_request.prefix_cache_id if lora_request is not None else None,
                self.model.prefix_cache_salt(len(ids)),
            )
            if params.prompt_logprobs is not None and len(ids) == 1:
                seq.prompt_logprobs = [None]
            if params.structured_outputs is not None:
                seq.grammar = self.structured.matcher(params.structured_outputs)
            if params.seed is not None:
                seq.generator = torch.Generator().manual_seed(params.seed + i * 1_000_003)
            seqs.append(seq)
        req = Request(request_id, text, ids, params, seqs, lora_request)
        if lora_key is None or self.lora_manager.is_resident(lora_key):
            req.metrics.adapter_ready_time = req.metrics.arrival_time
        else:
            self._awaiting_adapter[request_id] = req
        # one prefill: the siblings fork from the first sequence once its prompt is computed
        self.scheduler.add(seqs[0])
        seqs[0].pending_forks = seqs[1:]
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
        if not self.requests:  # the engine goes idle: the last step's cycle ends now
            self._observe_cycle(time.perf_counter())
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # --- the step -------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one engine step; returns an output for every request that advanced."""
        return [r.to_output() for r in self.step_requests()]

    def step_requests(self) -> list[Request]:
        """Like ``step`` but returns the Request records (the async engine snapshots them).
        The three phases, each handing plain data to the next: the scheduler's plan, the
        runner's :meth:`execute`, the scheduler's ``update_from_output``; then the requests'
        bookkeeping."""
        t0 = time.perf_counter()
        self._observe_cycle(t0)
        if self._awaiting_adapter:
            self._note_adapters_ready()
        failed = self._fail_broken_adapters()
        plan = self.scheduler.schedule()
        if plan.is_empty:
            self.lora_manager.poll(wait=0.005)
            return failed
        output = self.execute(plan)
        self.num_steps += 1
        outcome = self.scheduler.update_from_output(plan, output)
        done = self._settle(outcome)
        if output.error is None:
            self._cycle = (plan, t0, outcome.num_forks)
            if not self.requests:  # nothing follows at once: the step ends here
                self._observe_cycle(time.perf_counter())
        seen = {r.request_id for r in done}
        return [*(r for r in failed if r.request_id not in seen), *done]

    def _note_adapters_ready(self) -> None:
        """Stamp the requests whose adapter reached a slot since the last step."""
        now = time.monotonic()
        for rid, req in list(self._awaiting_adapter.items()):
            key = req.lora_request.key
            if req.finished or req.aborted:
                del self._awaiting_adapter[rid]
            elif self.lora_manager.is_resident(key) or req.metrics.first_scheduled_time is not None:
                req.metrics.adapter_ready_time = now
                del self._awaiting_adapter[rid]

    def _observe_cycle(self, now: float) -> None:
        """Feed the step budget the last step's whole cycle: from its planning to the start of
        the next step (outputs delivered, commands run), the gap a decode row sees between two
        tokens; a step after which the engine had nothing left is measured to its own end."""
        if self._cycle is None:
            return
        plan, t0, forks = self._cycle
        self._cycle = None
        self.scheduler.observe_step(plan, now - t0, extra_rows=forks)

    def execute(self, plan: SchedulerOutput) -> ModelOutput:
        """Phase 2: order the rows, run the model with the step's adapters; a batch-level
        failure (e.g. an allocation) comes back as ``ModelOutput.error``."""
        try:
            batch = self.runner.order(plan, self.lora_manager.slot_of)
            now = time.monotonic()
            for row in batch.rows:
                metrics = self.requests[row.request_id].metrics
                if metrics.first_scheduled_time is None:
                    metrics.first_scheduled_time = now
            self.lora_manager.prepare_step(batch.row_lora_keys, batch.num_new_tokens)
            try:
                logits, prompt_logits, draft_logits = self.runner.execute(batch, plan.copies)
            finally:
                self.lora_manager.finish_step()
        except Exception as exc:
            logger.exception("engine step failed; failing its %d sequences", len(plan.scheduled))
            return ModelOutput(plan.scheduled, error=exc)
        return ModelOutput(batch.rows, logits, prompt_logits, draft_logits)

    def _settle(self, outcome: StepOutcome) -> list[Request]:
        """The requests' side of a step: failed ones end (error attached), timestamps, and
        finished ones leave the table. Returns the requests that changed."""
        touched = {rid: self.requests[rid] for rid in outcome.advanced if rid in self.requests}
        for req in self.fail_requests(outcome.failed):
            touched[req.request_id] = req
        now = time.monotonic()
        target = self.scheduler.itl_target()
        for req in touched.values():
            m = req.metrics
            if m.first_token_time is None:
                m.first_token_time = now
            elif m.last_token_time is not None:
                gap = now - m.last_token_time
                m.inter_token_latencies.append(gap)
                if target is not None and gap > target:
                    m.itl_misses += 1
            m.last_token_time, m.itl_target = now, target
            if req.finished:
                req.metrics.finished_time = now
                self.requests.pop(req.request_id, None)
        return list(touched.values())

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

    def _queue_full_for(self, fairness_key: str | None, max_waiting: int) -> bool:
        """Past ``max_waiting`` a request is refused only when its key already holds its
        share of the queue (``max_waiting`` ÷ the keys waiting, itself included): one key's
        flood fills the queue for itself, never for a neighbour."""
        waiting = self.scheduler.waiting
        if len(waiting) < max_waiting:
            return False
        per_key = Counter(seq.fairness_key for seq in waiting)
        keys = len(per_key) + (fairness_key not in per_key)
        return per_key[fairness_key] >= max_waiting // keys

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
        listeners = self.kv.listeners
        listeners.append(listener)

        def remove() -> None:
            if listener in listeners:
                listeners.remove(listener)
        return remove

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

    def _fail_broken_adapters(self) -> list[Request]:
        """Finish the requests whose adapter failed to load, with the load error attached."""
        broken = self.lora_manager.failed()
        if not broken:
            return []
        out = []
        for req in list(self.requests.values()):
            key = req.lora_request.key if req.lora_request is not None else None
            if key in broken:
                req.error = broken[key]
                self.abort_request(req.request_id)
                out.append(req)
        return out
