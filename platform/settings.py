"""Service settings: the one place the service reads flags and ``LORAMUX_*`` variables.

Every field is a ``loramux serve`` flag (``--max-loras``; its ``description`` is the help
text) and a ``LORAMUX_*`` environment variable (``LORAMUX_MAX_LORAS=8``); a flag wins
over the variable, the variable over the default. The registry commands take the
registry and model fields the same way. A new option is one field here. Field docs are
declared (``Field(description=...)``, and ``field(metadata={"doc": ...})`` in the limit
dataclasses these fields derive from), never read from source: only ``.pyc`` files may
ship.

What the settings build (the engine's config, the registry, request caps, default
quotas) is in :mod:`loramux.platform.builders`; the flags are generated from the fields
by :mod:`loramux.platform.cli.flags`.
"""

from __future__ import annotations

import dataclasses
import json
import typing
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import AliasChoices, Field, SecretStr, create_model, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from loramux.engine.config import (
    CacheConfig,
    LoRAConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    StructuredOutputConfig,
)
from loramux.engine.spec_decode.config import SpeculativeConfig
from loramux.platform.bulkheads import DependencyPolicy
from loramux.platform.cluster.routing import RouterConfig
from loramux.platform.limits.request import RequestLimits
from loramux.platform.usage.policy import UsagePolicy
from loramux.registry.budgets import DependencyBudgets
from loramux.registry.quotas import Quotas
from loramux.registry.stored_responses import ResponseStoreLimits

if TYPE_CHECKING:
    pass

DEFAULT_MODEL_ALIASES = ("SmolLM2-135M-Instruct", "HuggingFaceTB/SmolLM2-135M-Instruct")
QUOTA_PREFIX = "default_"
"""``Settings.default_<quota>`` is the quota of every tenant without its own."""


def field_docs(cls: type) -> dict[str, str]:
    """The declared doc of each field of a dataclass (``field(metadata={"doc": ...})``)."""
    return {f.name: f.metadata.get("doc", "") for f in dataclasses.fields(cls)}


def _fields_of(dataclass: type, prefix: str = "", doc_suffix: str = "") -> dict[str, Any]:
    """One settings field per dataclass field: same type, default and docstring."""
    hints = typing.get_type_hints(dataclass)
    docs = field_docs(dataclass)
    return {
        prefix + f.name: (hints[f.name], Field(default=f.default,
                                               description=docs.get(f.name, "") + doc_suffix))
        for f in dataclasses.fields(dataclass)
    }


_LimitSettings = create_model(  # caps, default quotas, dependency budgets, usage: one source of truth
    "_LimitSettings",
    __base__=BaseSettings,
    **_fields_of(RequestLimits),
    **_fields_of(Quotas, QUOTA_PREFIX, " Default for tenants without their own quotas "
                 "(`loramux tenants quota`); None = unlimited."),
    **_fields_of(DependencyBudgets),
    **_fields_of(DependencyPolicy),
    **_fields_of(UsagePolicy),
    **_fields_of(ResponseStoreLimits),
)


class Settings(_LimitSettings):
    """Everything ``loramux serve`` needs; engine options keep vLLM's names."""

    model_config = SettingsConfigDict(
        env_prefix="LORAMUX_", extra="ignore"
    )

    # --- engine (names as in vLLM; defaults are the engine's, engine/config.py) ----------
    model: str | None = Field(ModelConfig.model, description=(
        "Base model: a local Hugging Face folder; None = SmolLM2-135M-Instruct."))
    served_model_name: Annotated[list[str], NoDecode] = Field(default_factory=list, description=(
        "Names the base model answers to in `model`; empty = the folder's name (for the default "
        "model also HuggingFaceTB/SmolLM2-135M-Instruct). The first is listed."))
    dtype: str = Field(ModelConfig.dtype, description=(
        "auto | float32 | bfloat16 | float16 (CUDA only)."))
    device: str = Field(ModelConfig.device, description="auto | cpu | cuda[:N].")
    seed: int = Field(ModelConfig.seed, description="Seed of the engine's random generators.")
    attention_backend: Literal["auto", "torch"] = Field(ModelConfig.attention_backend, description=(
        "auto: the C kernel reading the paged KV cache in place on the CPU (Triton on CUDA); "
        "torch: gather each context, then SDPA (the reference path)."))
    quantization: str | None = Field(ModelConfig.quantization, description=(
        "vLLM's option: the quantization method the checkpoint must have (compressed-tensors, awq, gptq); "
        "None = what its quantization_config says."))
    enforce_eager: bool = Field(ModelConfig.enforce_eager, description=(
        "vLLM's flag: the layer's small ops as separate torch ops instead of the fused CPU "
        "kernels (engine/model/small_ops.py)."))
    max_model_len: int | None = Field(ModelConfig.max_model_len, description=(
        "Longest prompt + output in tokens; None = the model's own limit."))
    tensor_parallel_size: int = Field(ParallelConfig.tensor_parallel_size, description=(
        "vLLM's option: ranks (devices; on the CPU, shares of the cores) the model and its "
        "adapters are sharded over, each a local worker process (docs/tensor-parallel.md)."))
    distributed_executor_backend: Literal["mp"] = Field(
        ParallelConfig.distributed_executor_backend, description=(
            "vLLM's option: how the tensor-parallel workers run (mp: local processes)."))
    tensor_parallel_timeout: float = Field(ParallelConfig.tensor_parallel_timeout, description=(
        "Seconds a collective or a worker's start may take before the engine restarts its workers."))
    max_num_seqs: int = Field(SchedulerConfig.max_num_seqs, description=(
        "Most sequences in one engine step."))
    max_num_batched_tokens: int | None = Field(SchedulerConfig.max_num_batched_tokens, description=(
        "Token budget of one engine step; None = the engine's default."))
    enable_chunked_prefill: bool = Field(SchedulerConfig.enable_chunked_prefill, description=(
        "Split long prompts over several steps so running decodes keep going (vLLM V1)."))
    enable_prefix_caching: bool = Field(CacheConfig.enable_prefix_caching, description=(
        "Reuse the KV of shared prompt prefixes; blocks are keyed per adapter version."))
    fairness_policy: Literal["vtc", "fcfs"] = Field(SchedulerConfig.fairness_policy, description=(
        "Engine admission order: vtc = fair share of tokens across tenants, fcfs = arrival "
        "order."))
    enable_step_budget: bool = Field(SchedulerConfig.enable_step_budget, description=(
        "Fill each engine step up to the inter-token latency target from a measured cost "
        "model: while decodes run, prompt chunks beside them shrink to fit it; while tenants "
        "compete their decode rows share it fairly (a flooder's surplus rotates)."))
    target_itl_ms: float | None = Field(default=SchedulerConfig.target_itl_ms, gt=0, description=(
        "Inter-token latency target in milliseconds: while any decode runs, a step's predicted "
        "time stays within it (prompt chunks take what is left); None = 3x the measured cost "
        "of a one-row decode step. /metrics counts the tokens that missed it."))
    target_ttft_ms: float | None = Field(default=SchedulerConfig.target_ttft_ms, gt=0, description=(
        "Time-to-first-token objective in milliseconds: a step gives waiting prompts more than "
        "the ITL target's chunk (up to the whole token budget) when that meets more requests' "
        "TTFT and TPOT objectives than it costs the running streams; None = 3x the measured "
        "cost of computing each prompt alone."))
    goodput_ttft_ms: float = Field(default=2000.0, gt=0, description=(
        "Goodput target: a request meets it when its time to first token is at most this (and "
        "its time per output token at most goodput_tpot_ms); /metrics exports the share."))
    goodput_tpot_ms: float = Field(default=250.0, gt=0, description=(
        "Goodput target: the most mean time per output token a request may take."))
    grammar_compile_timeout: float = Field(
        StructuredOutputConfig.grammar_compile_timeout, description=(
        "Seconds a request's structured-output grammar may take to compile (off the engine "
        "thread); past it the request fails."))
    grammar_cache_size: int = Field(StructuredOutputConfig.grammar_cache_size, description=(
        "Compiled structured-output grammars kept (LRU)."))
    speculative_config: str | None = Field(None, description=(
        'vLLM\'s speculative decoding config as JSON, e.g. {"method": "ngram", '
        '"num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}: drafts '
        "from each sequence's own prompt and output, verified in one forward pass with its "
        "adapter; outputs are those of decoding without it. None = off."))
    # the service bounds the queue on purpose (the engine's default: no bound)
    max_waiting: int = Field(1024, description=(
        "Bound of the engine's waiting queue; past it requests get 429 with Retry-After."))
    block_size: int = Field(CacheConfig.block_size, description="Tokens per KV-cache block.")
    gpu_memory_utilization: float = Field(CacheConfig.gpu_memory_utilization, description=(
        "Share of the GPU's memory the engine may use."))
    kv_cache_memory: int | None = Field(CacheConfig.kv_cache_memory, description=(
        "CPU only: bytes for the KV cache (None = the engine's default)."))
    num_gpu_blocks_override: int | None = Field(CacheConfig.num_gpu_blocks_override, description=(
        "Exact number of KV-cache blocks (tests, benchmarks)."))
    # on in the service on purpose (off in the offline LLM, as in vLLM)
    enable_lora: bool = Field(True, description="Serve LoRA adapters.")
    max_loras: int | None = Field(LoRAConfig.max_loras, description=(
        "At most this many adapters in one step, one device slot each (vLLM's meaning); None = "
        "as many as the adapter memory holds (see lora_memory)."))
    max_lora_rank: int = Field(LoRAConfig.max_lora_rank, description=(
        "Largest adapter rank served; uploads of a larger rank are refused."))
    max_cpu_loras: int | None = Field(LoRAConfig.max_cpu_loras, description=(
        "Adapters kept in CPU memory (LRU); None = the engine's default."))
    lora_backend: str = Field(LoRAConfig.lora_backend, description="auto | torch | triton.")
    lora_memory: int | None = Field(LoRAConfig.lora_memory, description=(
        "Bytes for adapters when max_loras is unset (CPU: slots + CPU tier; GPU: slots, taken "
        "before the KV cache); None = the engine's default."))
    lora_load_workers: int = Field(LoRAConfig.lora_load_workers, description=(
        "Cold adapters read from disk or the object store at once; more wait in fair order."))
    fully_sharded_loras: bool = Field(LoRAConfig.fully_sharded_loras, description=(
        "vLLM's option: under tensor parallelism also split A by rank and B by output columns "
        "(the S-LoRA layout: 1/N of every adapter per rank, one small collective per LoRA "
        "layer; docs/tensor-parallel.md)."))
    lora_modules: Annotated[list[str], NoDecode] = Field(default_factory=list, description=(
        'Static adapters every caller may use: name=path or {"name": .., "path": ..}.'))

    # --- tool calling and reasoning (vLLM's flags; see docs/tool-calling.md) -------------
    enable_auto_tool_choice: bool = Field(False, description=(
        "vLLM's flag: tool_choice \"auto\" (the default when a request has tools) parses the "
        "model's tool calls with --tool-call-parser. Adapters that name their own parser get "
        "it without this flag."))
    tool_call_parser: str | None = Field(None, description=(
        "Tool-call parser of the base model and of adapters without their own: hermes, "
        "llama3_json, pythonic, mistral, qwen3_xml (and their vLLM aliases), or a plugin's."))
    tool_parser_plugin: str = Field("", description=(
        "A Python file (or module) that registers tool parsers (vLLM's plugin flag)."))
    reasoning_parser: str | None = Field(None, description=(
        "Reasoning parser (deepseek_r1, qwen3, olmo3, or a plugin's): the thought goes to "
        "message.reasoning, the answer to content."))
    reasoning_parser_plugin: str = Field("", description=(
        "A Python file (or module) that registers reasoning parsers."))
    tool_strict_level: Literal["auto", "function", "parameter"] = Field("auto", description=(
        "vLLM's --tool-strict-level. auto: tool_choice required / a named function constrain "
        "the call's format, and arguments follow the parameters schema of tools marked "
        "strict: true (auto also constrains calls when a tool is strict); function: calls "
        "are constrained for every request with tools; parameter: also every tool's "
        "arguments, as if all were strict."))
    structured_outputs_config: str | None = Field(None, description=(
        'vLLM\'s structured outputs config as JSON, e.g. {"enable_in_reasoning": true} (the '
        "grammar constrains the thought too; by default only the answer after it); keys: "
        "backend (auto | xgrammar), enable_in_reasoning, reasoning_parser."))
    exclude_tools_when_tool_choice_none: bool = Field(False, description=(
        "vLLM's flag: requests with tool_choice \"none\" render no tools into the prompt."))


    # --- HTTP --------------------------------------------------------------------------
    host: str = Field("127.0.0.1", description="Bind address.")
    port: int = Field(8000, description="Bind port.")
    root_path: str = Field("", description="ASGI root path behind a proxy.")
    log_level: str = Field("info", description="debug | info | warning | error.")
    log_format: str = Field("json", description=(
        "json (one object per line, with request ids) | text."))
    max_request_bytes: int = Field(8 * 1024 * 1024, description=(
        "Largest JSON request body; larger ones get 413."))
    max_upload_bytes: int = Field(1024 * 1024 * 1024, description=(
        "Largest adapter upload (all files together); larger ones get 413."))
    max_prompts_per_request: int = Field(64, description=(
        "Most prompts in one /v1/completions request."))
    retry_after_seconds: int = Field(1, description=(
        "The Retry-After of a 429 when the waiting queue is full."))
    allow_anonymous: bool = Field(False, description=(
        "Requests without a valid key may use the base model and --lora-modules (like `vllm "
        "serve` without --api-key). Tenant adapters always need a key."))
    shutdown_timeout: float = Field(30.0, description=(
        "Seconds SIGTERM waits for requests in flight (new ones get 503, /ready says not "
        "ready); past it the rest end with an error. The Helm chart's grace period follows it."))
    model_cache_ttl: float = Field(5.0, description=(
        "Seconds a resolved (tenant, model) pair is cached."))
    front_end_nice: int = Field(0, ge=0, le=19, description=(
        "Linux nice levels the HTTP front end's threads (the event loop and the threads it "
        "starts) run below the engine's step thread and its OpenMP team (loramux.platform."
        "priority): on a 2-core CPU 10 sped the base model's streams up and slowed adapters' "
        "down. 0 = the same priority."))

    # --- registry / auth -----------------------------------------------------------------
    database_url: str | None = Field(None, description=(
        "SQLAlchemy URL; None = SQLite in the data dir."))
    s3_bucket: str | None = Field(None, description=(
        "Object store bucket; None = a folder in the data dir."))
    s3_endpoint_url: str | None = Field(None, description=(
        "S3 endpoint (MinIO, R2, Ceph); None = AWS."))
    s3_prefix: str = Field("", description="Key prefix inside the bucket.")
    s3_region: str | None = Field(None, description="S3 region; None = boto3's default.")
    data_dir: Path | None = Field(None, description=(
        "Where SQLite, the local object store and caches live; None = ~/.local/share/loramux."))
    max_adapter_bytes: int = Field(1024**3, description=(
        "Largest adapter (weights) the registry accepts."))
    admin_key: SecretStr | None = Field(None, description=(
        "Bearer key of /admin; None = generated on first start (printed once, stored hashed)."))
    demo: bool = Field(True, description=(
        "On a registry without tenants: create a demo tenant with the shipped sql-lora adapter "
        "and print its key once."))
    demo_adapter_dir: Path | None = Field(None, description=(
        "The adapter registered for the demo tenant; None = examples/adapters/sql-lora."))

    # --- cluster (``--role gateway|engine``; see loramux.platform.cluster) ---------------
    role: str = Field("all", description="all (one process: today's server) | gateway | engine.")
    redis_url: str | None = Field(None, description=(
        "Cluster state, routing view, pub/sub fan-out and the gateways' shared tenant rate "
        "limits (None with role all = in-process limits); required by gateway and engine."))
    redis_namespace: str = Field("loramux", description=(
        "Prefix of every Redis key and channel (several clusters can share one Redis)."))
    cluster_secret: SecretStr | None = Field(None, description=(
        "Shared by gateways and engines (header ``X-LoRAMux-Cluster-Secret``); required by both "
        "roles. Engines refuse inference and admin requests without it."))
    advertise_url: str | None = Field(None, description=(
        "Engine: the URL gateways reach it at; None = ``http://{host}:{port}``."))
    heartbeat_interval: float = Field(1.0, description=(
        "Engine: seconds between heartbeats. Gateway: seconds between reads of the pool."))
    heartbeat_ttl: float = Field(5.0, description=(
        "Seconds without a heartbeat after which an engine leaves the pool."))
    route_queue_threshold: int = Field(RouterConfig.queue_threshold, description=(
        "Gateway: queued requests past an engine's ``max_num_seqs`` before it spills over."))
    route_load_factor: float = Field(RouterConfig.load_factor, description=(
        "Gateway: an engine past the queue threshold keeps its adapters while its load is "
        "within this multiple of the fleet's mean."))

    # --- behind an inference gateway (InferencePool + endpoint picker; platform/inference_gateway)
    protocol_metrics_port: int | None = Field(None, description=(
        "Serve the model-server protocol metrics (vLLM's vllm:* gauges, for an endpoint "
        "picker) on this port of --host, from a separate process; None = off. It carries "
        "every tenant's adapter names (names only): expose it to the picker alone."))
    kv_events_endpoint: str | None = Field(None, description=(
        "Publish prefix-cache KV events over ZeroMQ in vLLM's format (tcp://*:5557 binds, "
        "tcp://host:port connects); None = off."))
    kv_events_topic: str | None = Field(None, description=(
        "Topic of every KV-event message; None = kv@<hostname>:<port>@<served model name>."))
    kv_events_max_queue_size: int = Field(100_000, gt=0, description=(
        "KV events queued for the publisher thread (vLLM's max_queue_size); past it events "
        "are dropped and counted (the engine step never waits)."))
    kv_events_hwm: int = Field(100_000, gt=0, description=(
        "ZeroMQ high-water mark of the KV-event socket (vLLM's hwm)."))
    allow_runtime_lora_updating: bool = Field(False, validation_alias=AliasChoices(
        "allow_runtime_lora_updating", "LORAMUX_ALLOW_RUNTIME_LORA_UPDATING",
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING"), description=(
        "Serve vLLM's POST /v1/load_lora_adapter and /v1/unload_lora_adapter for the "
        "caller's tenant (vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING=true is honoured too)."))
    lora_path_allow: Annotated[list[str], NoDecode] = Field(default_factory=list, description=(
        "Local folders /v1/load_lora_adapter may read adapters from ({tenant} = the "
        "caller's tenant name, e.g. /mnt/loras/{tenant}/); empty = only s3:// imports."))

    @field_validator("speculative_config")
    @classmethod
    def _speculative(cls, value: str | None) -> str | None:
        SpeculativeConfig.parse(value)  # a bad config stops the server at start, naming the key
        return value

    @field_validator("structured_outputs_config")
    @classmethod
    def _structured_config(cls, value: str | None) -> str | None:
        from loramux.platform.openai.tool_config import parse_structured_outputs_config

        parse_structured_outputs_config(value)  # refused at start, naming the key
        return value

    @field_validator("role")
    @classmethod
    def _role(cls, value: str) -> str:
        if value not in ("all", "gateway", "engine"):
            raise ValueError(f"role must be all, gateway or engine, got {value!r}")
        return value

    # --- tenants cannot hurt each other (request caps and default quotas: see above) -----
    quota_cache_ttl: float = Field(5.0, description=(
        "Seconds a tenant's quotas are cached (a change through this server is immediate)."))
    metrics_public: bool = Field(False, description=(
        "Serve /metrics without the admin key (it names every tenant's adapters)."))
    s3_import_allow: Annotated[list[str], NoDecode] = Field(default_factory=list, description=(
        "s3://bucket/prefix/ sources tenants may import adapters from (besides their own "
        "prefix, s3://<s3-bucket>/<s3-prefix>/imports/tenant-<id>/); empty = only their own."))

    @field_validator("served_model_name", "lora_modules", "s3_import_allow", mode="before")
    @classmethod
    def _split(cls, value):
        if isinstance(value, str):
            value = value.strip()
            if value.startswith("["):
                return json.loads(value)
            return [v for v in value.replace(",", " ").split() if v] if "{" not in value else [value]
        return value

    @field_validator("lora_path_allow", mode="before")
    @classmethod
    def _split_paths(cls, value):
        if isinstance(value, str):
            value = value.strip()
            return json.loads(value) if value.startswith("[") else [
                v for v in value.replace(",", " ").split() if v]
        return value

    @field_validator("log_format")
    @classmethod
    def _log_format(cls, value: str) -> str:
        if value not in ("json", "text"):
            raise ValueError(f"log_format must be json or text, got {value!r}")
        return value


def setting_default(name: str) -> Any:
    """The default of the :class:`Settings` field ``name``: what a component built outside
    ``Settings`` (tests, the offline API) uses, so the default is written once."""
    return Settings.model_fields[name].get_default(call_default_factory=True)
