"""Engine configuration: one dataclass per area, validated in ``__post_init__``.

Option names follow vLLM where the meaning is the same. The defaults are written here
only: ``LLM(...)`` and the service's ``Settings`` read them (``ModelConfig.dtype`` is the
default), and :meth:`EngineConfig.from_options` builds the nested config from flat options
for both.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from loramux.adapters.limits import DEFAULT_MAX_LORA_RANK
from loramux.engine.model.quant import check_quantization_name
from loramux.engine.spec_decode.config import SpeculativeConfig

_CPU_DTYPES = ("float32", "bfloat16")
_CUDA_DTYPES = ("float32", "bfloat16", "float16")


@dataclass
class ModelConfig:
    """Which model to run and how."""

    model: str | None = None
    """Hugging Face folder of a supported model (``adapters.arch.ARCHITECTURES``); None = the default model."""
    tokenizer: str | None = None
    """Tokenizer folder; None = the model folder."""
    dtype: str = "auto"
    """auto | float32 | bfloat16 | float16 (CUDA only)."""
    device: str = "auto"
    """auto | cpu | cuda[:N]."""
    max_model_len: int | None = None
    """Longest prompt + output in tokens; None = the model's max_position_embeddings."""
    seed: int = 0
    """Seed of the engine's generator for unseeded sampled requests."""
    attention_backend: str = "auto"
    """auto | torch. auto: on the CPU the compiled C kernel that reads the paged cache in
    place (falls back to torch, logging why, when the compiled kernels are missing), Triton on CUDA;
    torch: the torch path (gathers each context, then SDPA)."""
    quantization: str | None = None
    """vLLM's option: the quantization method the checkpoint must have (``compressed-tensors``, ``awq``, ``gptq``;
    ``engine/model/quant/``); None = whatever its ``quantization_config`` says (none: float)."""
    enforce_eager: bool = False
    """vLLM's flag: run the layer's small ops (residual add + RMSNorm, rotary embedding,
    SiLU-and-mul) as separate torch ops. False: on the CPU each runs as one fused compiled
    operator (``engine/model/small_ops.py``; falls back to eager, logging why, when the
    compiled kernels are missing); CUDA always runs them eagerly."""

    def __post_init__(self) -> None:
        if self.attention_backend not in ("auto", "torch"):
            raise ValueError(f"attention_backend must be auto or torch; got {self.attention_backend!r}")
        if self.dtype not in ("auto",) + _CUDA_DTYPES:
            raise ValueError(f"dtype must be one of auto, float32, bfloat16, float16; got {self.dtype!r}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        check_quantization_name(self.quantization)


@dataclass
class CacheConfig:
    """Paged KV cache sizing."""

    block_size: int = 16
    """Tokens per KV block."""
    gpu_memory_utilization: float = 0.9
    """CUDA: fraction of device memory the engine may use (weights + KV cache)."""
    kv_cache_memory: int | None = None
    """CPU: bytes for the KV cache; None = 2 GiB capped at what max_num_seqs full sequences need."""
    num_gpu_blocks_override: int | None = None
    """Exact number of KV blocks (tests, benchmarks)."""
    enable_prefix_caching: bool = True
    """Reuse the KV of full blocks whose tokens, prefix and adapter match (hash chain)."""

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two >= 1, got {self.block_size}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be > 0 bytes, got {self.kv_cache_memory}")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 1:
            raise ValueError("num_gpu_blocks_override must be >= 1")


@dataclass
class SchedulerConfig:
    """Continuous-batching limits."""

    max_num_seqs: int = 256
    """Most sequences in one step."""
    max_num_batched_tokens: int | None = None
    """Most tokens in one step; None = 2048 with chunked prefill, else max(2048, max_model_len)."""
    enable_chunked_prefill: bool = True
    """Split prompts longer than what is left of a step's token budget over several steps."""
    max_waiting: int | None = None
    """Bound of the waiting queue (None = unbounded); the HTTP layer answers 429 past it to
    a fairness key that already holds its share of the queue (others still get in)."""
    starvation_steps: int = 64
    """An adapter whose waiting request was skipped this many steps for want of a slot is
    starving: it gets the next slot, and a busy adapter is drained (then preempted after as
    many steps) to free one (``engine/lora/admission.py``)."""
    fairness_policy: str = "vtc"
    """Admission and preemption order: ``vtc`` (fair share of tokens across fairness keys,
    the Virtual Token Counter) or ``fcfs`` (arrival order)."""
    enable_step_budget: bool = True
    """Fill each step up to the ITL target from a measured cost model
    (``engine/step_budget.py``): while decode rows run, prompt chunks shrink to fit it; while
    keys compete, decode rows are shared fairly within it."""
    target_itl_ms: float | None = None
    """Inter-token latency target in milliseconds: while any decode row runs, a step's
    predicted time stays within it (prompt chunks fill what is left, at least a minimum chunk;
    a prompt alone gets the whole token budget); while keys compete a step aims at half of it.
    None = derived: 3× the measured one-row decode step (for a key alone, at least 3× the
    step of its running decodes)."""
    target_ttft_ms: float | None = None
    """Time-to-first-token objective in milliseconds: beside the ITL target it makes the
    goodput count (``engine/goodput.py``) by which a step gives waiting prompts more than the
    ITL target's chunk while the running streams keep their TPOT. None = derived per prompt:
    3× the measured cost of computing that prompt alone."""

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")
        if self.max_waiting is not None and self.max_waiting < 0:
            raise ValueError("max_waiting must be >= 0")
        for name in ("target_itl_ms", "target_ttft_ms"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be > 0, got {value}")
        if self.fairness_policy not in ("vtc", "fcfs"):
            raise ValueError(f"fairness_policy must be vtc or fcfs, got {self.fairness_policy!r}")

    def token_budget(self, max_model_len: int) -> int:
        """The resolved ``max_num_batched_tokens``."""
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        return 2048 if self.enable_chunked_prefill else max(2048, max_model_len)


DEFAULT_CPU_LORA_MEMORY = 3 << 30
"""CPU: bytes for adapters (device slots + CPU tier) when ``max_loras`` and ``lora_memory``
are unset: 40 rank-32 adapters of a 135M model with fp32 slots (AVX2) and bf16 CPU copies;
slot pages are committed only as slots fill."""
GPU_LORA_MEMORY_SHARE = 0.1
"""CUDA: share of the memory left after the weights that adapter slots take when
``max_loras`` and ``lora_memory`` are unset (the KV cache gets the rest)."""
MAX_DERIVED_LORAS = 256
"""Most slots a derived capacity gives (a tiny model's slots are tiny)."""


@dataclass
class LoRAConfig:
    """Multi-LoRA serving limits."""

    max_loras: int | None = None
    """At most this many distinct adapters in one step, one device slot each (vLLM's
    meaning); None = as many as the adapter memory holds (``engine/lora/capacity.py``)."""
    max_lora_rank: int = DEFAULT_MAX_LORA_RANK
    """Largest rank a slot holds (the registry refuses uploads above it by the same default)."""
    max_cpu_loras: int | None = None
    """Adapters kept in CPU memory (LRU); None = 2 * max_loras when that is set, else
    derived with the slots (on the CPU: one CPU-tier copy per slot)."""
    lora_backend: str = "auto"
    """auto | torch | triton."""
    lora_dtype: str = "auto"
    """dtype of slot buffers; auto = the base projections' matmul dtype (fp32 for bf16 on CPUs
    without bf16 GEMMs), the CPU tier then keeps the model's dtype."""
    lora_memory: int | None = None
    """Bytes for adapters when max_loras is unset: CPU = slots + CPU tier (None =
    DEFAULT_CPU_LORA_MEMORY); CUDA = slots, taken before the KV cache (None =
    GPU_LORA_MEMORY_SHARE of the memory left after the weights)."""
    fully_sharded_loras: bool = False
    """vLLM's option, under tensor parallelism: also split each adapter's A by rank on
    column-parallel projections and B by output columns on row-parallel ones (the S-LoRA
    layout, ``lora/sharded.py``): each rank's slots hold ``1/N`` of every adapter, for one
    small collective per LoRA group and layer. No effect on one rank."""
    lora_load_workers: int = 2
    """Cold adapters read from disk (or fetched from the adapter source) at once, each on its
    own thread (capped by the CPU tier's size: their weights are held beside it); further
    loads wait in admission's fair order, so one tenant's burst of cold adapters does not
    queue a neighbour's load behind all of its own. Reading and checking an adapter is
    CPU work: on 2 cores more than 2 at once slowed each other (4 read at 175-241 ms each
    where one alone took 72-95); raise it where loads wait on a slow disk or object store."""

    def __post_init__(self) -> None:
        if not 1 <= self.lora_load_workers <= 64:
            raise ValueError(f"lora_load_workers must be in [1, 64], got {self.lora_load_workers}")
        if self.max_loras is not None and self.max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {self.max_loras}")
        if not 1 <= self.max_lora_rank <= 512:
            raise ValueError(f"max_lora_rank must be in [1, 512], got {self.max_lora_rank}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < 1:
            raise ValueError(f"max_cpu_loras must be >= 1, got {self.max_cpu_loras}")
        if (
            self.max_loras is not None
            and self.max_cpu_loras is not None
            and self.max_cpu_loras < self.max_loras
        ):
            raise ValueError(
                f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})"
            )
        if self.lora_memory is not None and self.lora_memory <= 0:
            raise ValueError(f"lora_memory must be > 0 bytes, got {self.lora_memory}")
        if self.lora_backend not in ("auto", "torch", "triton"):
            raise ValueError(f"lora_backend must be auto, torch or triton; got {self.lora_backend!r}")


@dataclass
class ParallelConfig:
    """How the model is spread over devices (``engine/distributed/``; vLLM's names)."""

    tensor_parallel_size: int = 1
    """Ranks the weights are sharded over (one device each; on the CPU, the cores are split
    between them): q/k/v and gate/up by output rows, o and down by input columns with one
    all-reduce each, LoRA B sliced by rows on the first and A by columns on the second."""
    distributed_executor_backend: str = "mp"
    """``mp``: this process is rank 0 and starts the other ranks as local processes."""
    tensor_parallel_timeout: float = 120.0
    """Seconds a collective or a worker's start may take before the engine gives up on its
    workers (fails the step's requests, restarts them)."""

    def __post_init__(self) -> None:
        if not 1 <= self.tensor_parallel_size <= 64:
            raise ValueError(f"tensor_parallel_size must be in [1, 64], got {self.tensor_parallel_size}")
        if self.distributed_executor_backend != "mp":
            raise ValueError("distributed_executor_backend must be 'mp' (local worker processes), "
                             f"got {self.distributed_executor_backend!r}")
        if not self.tensor_parallel_timeout > 0:
            raise ValueError("tensor_parallel_timeout must be > 0")


@dataclass
class StructuredOutputConfig:
    """Grammar compilation limits (structured outputs)."""

    grammar_compile_timeout: float = 10.0
    """Seconds a request's grammar may take to compile (off the engine thread); past it
    the request fails with a clear error."""
    grammar_cache_size: int = 128
    """Compiled grammars kept (LRU)."""

    def __post_init__(self) -> None:
        if not self.grammar_compile_timeout > 0:
            raise ValueError("grammar_compile_timeout must be > 0")
        if self.grammar_cache_size < 1:
            raise ValueError("grammar_cache_size must be >= 1")


@dataclass
class EngineConfig:
    """Everything the engine needs, in one place."""

    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    lora: LoRAConfig | None = None
    """None = LoRA disabled."""
    structured: StructuredOutputConfig = field(default_factory=StructuredOutputConfig)
    speculative: SpeculativeConfig | None = None
    """Speculative decoding (vLLM's ``speculative_config``); None = off."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    @classmethod
    def from_options(cls, *, enable_lora: bool = False, speculative_config: Any = None,
                     **options: Any) -> EngineConfig:
        """The nested config of flat vLLM-style options (``max_num_seqs=8, max_loras=2``);
        options left out keep their defaults; ``enable_lora`` False = no LoRA config (its
        options are then ignored); ``speculative_config``: vLLM's JSON string or dict
        (:meth:`SpeculativeConfig.parse`). An unknown option is a ``TypeError``."""
        parts: dict[str, Any] = {"speculative": SpeculativeConfig.parse(speculative_config)}
        for name, part in (("model", ModelConfig), ("cache", CacheConfig),
                           ("scheduler", SchedulerConfig), ("structured", StructuredOutputConfig),
                           ("parallel", ParallelConfig), ("lora", LoRAConfig)):
            given = {f.name: options.pop(f.name) for f in fields(part) if f.name in options}
            parts[name] = part(**given) if name != "lora" or enable_lora else None
        if options:
            raise TypeError(f"unknown engine options: {sorted(options)}")
        return cls(**parts)
