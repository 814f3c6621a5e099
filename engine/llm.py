"""Offline API, vLLM-compatible: ``LLM(...).generate(prompts, sampling_params)``."""

from __future__ import annotations

import warnings
from collections.abc import Sequence as Seq
from dataclasses import dataclass

from tqdm.auto import tqdm

from loramux.engine.config import (
    CacheConfig,
    EngineConfig,
    LoRAConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)
from loramux.engine.engine import AdapterSource, LLMEngine, PromptType
from loramux.engine.lora_request import LoRARequest
from loramux.engine.outputs import RequestOutput
from loramux.engine.sampling_params import SamplingParams


class LLM:
    """A base model (plus LoRA adapters) for offline batched generation.

    Code written for ``vllm.LLM`` runs by changing the import.
    """

    def __init__(
        self,
        model: str | None = ModelConfig.model,
        *,
        tokenizer: str | None = ModelConfig.tokenizer,
        dtype: str = ModelConfig.dtype,
        device: str = ModelConfig.device,
        seed: int = ModelConfig.seed,
        max_model_len: int | None = ModelConfig.max_model_len,
        attention_backend: str = ModelConfig.attention_backend,
        enforce_eager: bool = ModelConfig.enforce_eager,
        quantization: str | None = ModelConfig.quantization,
        max_num_seqs: int = SchedulerConfig.max_num_seqs,
        max_num_batched_tokens: int | None = SchedulerConfig.max_num_batched_tokens,
        enable_chunked_prefill: bool = SchedulerConfig.enable_chunked_prefill,
        enable_prefix_caching: bool = CacheConfig.enable_prefix_caching,
        enable_step_budget: bool = SchedulerConfig.enable_step_budget,
        target_itl_ms: float | None = SchedulerConfig.target_itl_ms,
        target_ttft_ms: float | None = SchedulerConfig.target_ttft_ms,
        block_size: int = CacheConfig.block_size,
        gpu_memory_utilization: float = CacheConfig.gpu_memory_utilization,
        kv_cache_memory: int | None = CacheConfig.kv_cache_memory,
        num_gpu_blocks_override: int | None = CacheConfig.num_gpu_blocks_override,
        enable_lora: bool = False,
        max_loras: int | None = LoRAConfig.max_loras,
        max_lora_rank: int = LoRAConfig.max_lora_rank,
        max_cpu_loras: int | None = LoRAConfig.max_cpu_loras,
        lora_backend: str = LoRAConfig.lora_backend,
        lora_memory: int | None = LoRAConfig.lora_memory,
        lora_load_workers: int = LoRAConfig.lora_load_workers,
        fully_sharded_loras: bool = LoRAConfig.fully_sharded_loras,
        speculative_config: dict | str | None = None,
        tensor_parallel_size: int = ParallelConfig.tensor_parallel_size,
        distributed_executor_backend: str = ParallelConfig.distributed_executor_backend,
        adapter_source: AdapterSource | None = None,
        **unused,
    ) -> None:
        """Options as in ``vllm.LLM``; their defaults are the engine's (``engine/config.py``).
        ``speculative_config``: vLLM's, e.g. ``{"method": "ngram", "num_speculative_tokens":
        4, "prompt_lookup_max": 4}`` (``engine/spec_decode/config.py``)."""
        check_vllm_arguments(unused)
        config = EngineConfig.from_options(
            model=model, tokenizer=tokenizer, dtype=dtype, device=device, seed=seed,
            max_model_len=max_model_len, attention_backend=attention_backend,
            enforce_eager=enforce_eager, quantization=quantization,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            enable_chunked_prefill=enable_chunked_prefill,
            enable_prefix_caching=enable_prefix_caching, block_size=block_size,
            enable_step_budget=enable_step_budget, target_itl_ms=target_itl_ms,
            target_ttft_ms=target_ttft_ms,
            gpu_memory_utilization=gpu_memory_utilization, kv_cache_memory=kv_cache_memory,
            num_gpu_blocks_override=num_gpu_blocks_override, enable_lora=enable_lora,
            max_loras=max_loras, max_lora_rank=max_lora_rank, max_cpu_loras=max_cpu_loras,
            lora_backend=lora_backend, lora_memory=lora_memory,
            lora_load_workers=lora_load_workers, fully_sharded_loras=fully_sharded_loras,
            speculative_config=speculative_config,
            tensor_parallel_size=tensor_parallel_size,
            distributed_executor_backend=distributed_executor_backend,
        )
        self.llm_engine = LLMEngine(config, adapter_source)
        self._counter = 0

    def get_tokenizer(self, lora_request: LoRARequest | None = None):
        """The base's tokenizer, or (vLLM's ``lora_request``) that adapter's: its own when it
        adds tokens."""
        return self.llm_engine.detokenizer.tokenizers.get(lora_request)

    def generate(
        self,
        prompts: PromptType | Seq[PromptType],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        *,
        use_tqdm: bool = False,
        lora_request: LoRARequest | Seq[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in prompt order."""
        if isinstance(prompts, (str, dict)) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]
        prompts = list(prompts)
        params = _per_prompt(sampling_params or SamplingParams(), len(prompts), "sampling_params")
        loras = _per_prompt(lora_request, len(prompts), "lora_request")
        ids = []
        for prompt, sp, lr in zip(prompts, params, loras, strict=True):
            rid = f"offline-{self._counter}"
            self._counter += 1
            self.llm_engine.add_request(rid, prompt, sp, lr)
            ids.append(rid)
        return self._run(ids, use_tqdm)

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        *,
        use_tqdm: bool = False,
        lora_request: LoRARequest | Seq[LoRARequest | None] | None = None,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        chat_template_kwargs: dict | None = None,
        tools: list[dict] | None = None,
    ) -> list[RequestOutput]:
        """Render one conversation (or a list of them) with the chat template, then generate.
        ``tools`` (OpenAI function tools) are rendered by the template, as vLLM's ``LLM.chat``
        does; the outputs are the model's text (parse calls from it with a tool parser)."""
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        tokenizers = self.llm_engine.detokenizer.tokenizers  # an adapter's own when it adds tokens
        prompts = [
            {
                "prompt_token_ids": render_chat(
                    tokenizers.get(lora), conv, add_generation_prompt, chat_template,
                    chat_template_kwargs, tools=tools,
                )
            }
            for conv, lora in zip(convs, _per_prompt(lora_request, len(convs), "lora_request"),
                                  strict=True)
        ]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)

    def beam_search(self, prompts, params, lora_request=None, use_tqdm: bool = False):
        """vLLM's beam search: ``BeamSearchParams(beam_width, max_tokens, ...)`` →
        one :class:`BeamSearchOutput` per prompt (best beams first)."""
        from loramux.engine.beam_search import beam_search

        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        return beam_search(self, list(prompts), params, lora_request)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        wanted = set(ids)
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm)
        while len(done) < len(ids):
            for req in engine.step_requests():
                if req.finished and req.request_id in wanted:
                    if req.error is not None:
                        for rid in ids:
                            engine.abort_request(rid)
                        raise req.error
                    done[req.request_id] = req.to_output()
                    bar.update()
        bar.close()
        return [done[i] for i in ids]


def render_chat(tokenizer, conversation, add_generation_prompt=True, chat_template=None, kwargs=None,
                tools=None) -> list[int]:
    """Token ids of a conversation rendered with the tokenizer's chat template (``tools``:
    the function tools the template renders, OpenAI shape)."""
    if not conversation:
        raise ValueError("messages must not be empty")
    text = tokenizer.apply_chat_template(
        conversation,
        tools=tools,
        tokenize=False,
        add_generation_prompt=add_generation_prompt,
        chat_template=chat_template,
        **(kwargs or {}),
    )
    return tokenizer(text, add_special_tokens=False).input_ids


def _per_prompt(value, n: int, name: str) -> list:
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise ValueError(f"{name} has {len(value)} entries for {n} prompts")
        return list(value)
    return [value] * n


@dataclass(frozen=True)
class _Unserved:
    """A ``vllm.LLM`` argument this engine does not act on."""

    default: object
    """vLLM's default: passing it changes nothing, so nothing is said."""
    refuse: bool
    """True: any other value is an error (the caller asked for something this engine does not
    do); False: a warning naming it (the value has no effect here)."""
    why: str


_VLLM_UNSERVED: dict[str, _Unserved] = {
    "swap_space": _Unserved(4, False, "preempted sequences are recomputed, never swapped"),
    "trust_remote_code": _Unserved(False, False, "no remote code is run: every family has its "
                                   "own implementation here"),
    "revision": _Unserved(None, False, "models are local folders (no hub download)"),
    "download_dir": _Unserved(None, False, "models are local folders (no hub download)"),
    "tokenizer_mode": _Unserved("auto", False, "the tokenizer is always transformers' "
                                "AutoTokenizer of the model folder"),
    "disable_log_stats": _Unserved(False, False, "the engine logs no periodic stats; its "
                                   "counters are in LLM.llm_engine.stats()"),
}
"""vLLM constructor arguments accepted for compatibility that this engine does not act on."""


def check_vllm_arguments(kwargs: dict) -> None:
    """Refuse unknown arguments, and vLLM arguments asking for what this engine does not do
    (ValueError naming them); warn about those whose value has no effect here."""
    unknown = sorted(k for k in kwargs if k not in _VLLM_UNSERVED)
    if unknown:
        raise TypeError(f"LLM() got unexpected keyword arguments: {unknown}")
    for name, value in kwargs.items():
        arg = _VLLM_UNSERVED[name]
        if value == arg.default:
            continue
        if arg.refuse:
            raise ValueError(f"{name}={value!r} is not supported: {arg.why}")
        warnings.warn(f"LLM(): {name}={value!r} has no effect: {arg.why}", UserWarning, stacklevel=3)
