"""loramux.engine: the base model runner, paged KV cache, continuous-batching
scheduler, LoRA layers and SGMV kernels, adapter slots, sampler, offline API."""

from loramux.engine.beam_search import BeamSearchParams
from loramux.engine.lora_request import LoRARequest
from loramux.engine.outputs import CompletionOutput, Logprob, RequestOutput
from loramux.engine.sampling_params import SamplingParams


def __getattr__(name: str):
    # The heavy parts (transformers, the model) import on first use.
    if name == "LLM":
        from loramux.engine.llm import LLM

        return LLM
    if name == "AsyncEngine":
        from loramux.engine.async_engine import AsyncEngine

        return AsyncEngine
    if name == "LLMEngine":
        from loramux.engine.engine import LLMEngine

        return LLMEngine
    raise AttributeError(name)


__all__ = [
    "LLM", "AsyncEngine", "LLMEngine", "SamplingParams", "LoRARequest",
    "RequestOutput", "CompletionOutput", "Logprob", "BeamSearchParams",
]
