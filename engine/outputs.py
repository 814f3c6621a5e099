"""Result objects of the offline and async APIs (vLLM-compatible shapes)."""

from __future__ import annotations

from dataclasses import dataclass, field

from loramux.engine.lora.state import ResidencySnapshot


@dataclass
class Logprob:
    """The logprob of one token, its rank in the distribution and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# Per generated position: token id -> Logprob (the sampled token and the top-N).
SampleLogprobs = list[dict[int, Logprob]]


@dataclass
class CompletionOutput:
    """One completion of a request."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None
    """'stop' (EOS, stop string or stop token), 'length', 'abort' or None while running."""
    stop_reason: int | str | None = None
    """The stop string or stop token id that ended the completion, None for EOS/length."""
    lora_request: object | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Timestamps (time.monotonic) of a request's life, and the gaps between its tokens
    (written on the engine thread; read them once the request finished)."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    adapter_ready_time: float | None = None
    """When its adapter was first seen in a device slot (its arrival when it was already
    there; None for the base model or before)."""
    last_token_time: float | None = None
    inter_token_latencies: list[float] = field(default_factory=list)
    """Seconds between consecutive steps that gave the request new tokens."""
    itl_target: float | None = None
    """The engine's inter-token latency target (seconds) as of its last token (None: none yet)."""
    itl_misses: int = 0
    """Gaps in :attr:`inter_token_latencies` longer than the target of their moment."""

    def record_token(self, now: float, itl_target: float | None) -> None:
        """The request advanced at ``now`` (settling a step): its first token, or one more gap
        between tokens, a miss when longer than ``itl_target`` (seconds; None: no target)."""
        if self.first_token_time is None:
            self.first_token_time = now
        elif self.last_token_time is not None:
            gap = now - self.last_token_time
            self.inter_token_latencies.append(gap)
            if itl_target is not None and gap > itl_target:
                self.itl_misses += 1
        self.last_token_time, self.itl_target = now, itl_target

    def timing(self) -> dict[str, float] | None:
        """Seconds spent in each phase, once it has a first token: ``queue`` (arrival to
        first scheduled step), ``adapter_load`` (the part of the queue wait its adapter was
        not in a slot yet), ``prefill`` (first scheduled step to first token) and ``decode``
        (first token to the end, or to now while it runs)."""
        if self.first_scheduled_time is None or self.first_token_time is None:
            return None
        ready = self.adapter_ready_time if self.adapter_ready_time is not None else self.arrival_time
        end = self.finished_time if self.finished_time is not None else self.last_token_time
        return {
            "queue": max(0.0, self.first_scheduled_time - self.arrival_time),
            "adapter_load": max(0.0, min(ready, self.first_scheduled_time) - self.arrival_time),
            "prefill": max(0.0, self.first_token_time - self.first_scheduled_time),
            "decode": max(0.0, (end or self.first_token_time) - self.first_token_time),
        }


@dataclass
class RequestOutput:
    """The state of a request: its prompt and its completions so far."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[dict[int, Logprob] | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    lora_request: object | None = None
    num_cached_tokens: int = 0
    extra: dict = field(default_factory=dict)


@dataclass
class EngineStats:
    """The engine's counters, one shape for ``LLMEngine.stats()`` and ``AsyncEngine.stats()``
    (metrics, readiness, the heartbeat and the dashboard read it)."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float
    """Fraction of KV blocks in use (0-1)."""
    num_preemptions: int
    prefix_cache_hit_rate: float = 0.0
    """Fraction of looked-up prompt blocks found in the prefix cache since start."""
    prefix_cache_queries: int = 0
    """Prompt blocks looked up in the prefix cache since start."""
    prefix_cache_hits: int = 0
    prefix_cache_evictions: int = 0
    cpu_kernels: str = "ok"
    """The compiled CPU kernels (``torch.ops.loramux``, ``model/kernels/loader.py``): ``ok``,
    ``disabled`` (``LORAMUX_CPU_KERNELS=0``) or ``degraded`` (not installed or not loading
    here: the CPU hot path runs on torch ops, several times slower)."""
    cpu_kernels_reason: str | None = None
    """Why the kernels are not ``ok`` (may name paths: for the admin only)."""
    num_steps: int = 0
    """Engine steps that ran a plan since start (with ``spec_decode``'s counters: drafted
    tokens per step)."""
    spec_decode: dict = field(default_factory=dict)
    """Speculative decoding per adapter key (``base`` = none) -> ``SpecCounts`` (drafts,
    drafted and accepted tokens since start); empty when it is off."""


@dataclass(frozen=True)
class LoadReport:
    """One engine's load as a model-server router reads it (``LLMEngine.load_report``),
    taken on the engine thread between steps; ``AsyncEngine.load_report()`` hands out the
    latest without waiting for the engine."""

    stats: EngineStats
    running_adapters: dict[str, int]
    """Adapter key -> sequences running with it."""
    waiting_adapters: dict[str, int]
    """Adapter key -> sequences waiting with it."""
    residency: ResidencySnapshot
    """Where each adapter sits (may be up to ``AsyncEngine.RESIDENCY_INTERVAL`` older)."""
    num_kv_blocks: int
    block_size: int
    taken_at: float
    """Unix time the report was taken."""
