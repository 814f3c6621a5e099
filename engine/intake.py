"""A new request's checks and sequences (``LLMEngine.add_request``): prompt tokens, the
context length, and the ``best_of`` sequences it starts as."""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection

import torch

from loramux.adapters.alora import activation_start
from loramux.engine.errors import ContextLengthError, PromptError
from loramux.engine.sampling_params import SamplingParams
from loramux.engine.sequence import LORA_NEVER, Sequence

PromptType = str | dict | list[int]


def tokenize(tokenizer, prompt: PromptType) -> tuple[str | None, list[int]]:
    """(prompt text, token ids) of a string, ``{"prompt_token_ids": [...]}`` or ``{"prompt": ...}``."""
    if isinstance(prompt, str):
        return prompt, tokenizer(prompt).input_ids
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            return prompt.get("prompt"), list(prompt["prompt_token_ids"])
        if "prompt" in prompt:
            return tokenize(tokenizer, prompt["prompt"])
        raise PromptError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        return None, list(prompt)
    raise PromptError(f"unsupported prompt type {type(prompt).__name__}")


def check_prompt(ids: list[int], params: SamplingParams, vocab: int, max_model_len: int) -> None:
    """Refuse a prompt that is empty, holds ids outside the vocabulary or leaves no room for
    its output (vLLM's messages)."""
    if not ids:
        raise PromptError("the prompt is empty")
    if min(ids) < 0 or max(ids) >= vocab:
        raise PromptError(f"prompt token ids must be in [0, {vocab})")
    params.verify_vocab(vocab)
    if len(ids) >= max_model_len:
        raise ContextLengthError(
            f"This model's maximum context length is {max_model_len} tokens. However, "
            f"your prompt has {len(ids)} tokens, leaving no room for output. Please reduce "
            f"the length of the prompt.", "prompt"
        )
    if params.max_tokens is not None and len(ids) + params.max_tokens > max_model_len:
        raise ContextLengthError(
            f"This model's maximum context length is {max_model_len} tokens. However, "
            f"you requested {len(ids) + params.max_tokens} tokens ({len(ids)} in the prompt, "
            f"{params.max_tokens} for the completion). Please reduce the length of the "
            f"prompt or max_tokens.", "max_tokens"
        )


def queue_full_for(waiting: Collection[Sequence], fairness_key: str | None, max_waiting: int) -> bool:
    """Past ``max_waiting`` a request is refused only when its key already holds its share of
    the ``waiting`` queue (``max_waiting`` ÷ the keys waiting, itself included): one key's
    flood fills the queue for itself, never for a neighbour."""
    if len(waiting) < max_waiting:
        return False
    per_key = Counter(seq.fairness_key for seq in waiting)
    keys = len(per_key) + (fairness_key not in per_key)
    return per_key[fairness_key] >= max_waiting // keys


def prefix_cache_id(adapter: str | None, salt: str | None) -> str | None:
    """A sequence's prefix-cache identity: its adapter's, and what the model says sets its
    keys apart (``DecoderModel.prefix_cache_salt``)."""
    if salt is None:
        return adapter
    return f"{adapter or ''}#{salt}"


def lora_start(ids: list[int], invocation: tuple[int, ...] | None) -> int:
    """Where the adapter starts in prompt ``ids`` (``Sequence.lora_start``): 0 for a plain
    LoRA (``invocation`` None), an aLoRA's last invocation, else :data:`LORA_NEVER`."""
    start = activation_start(ids, invocation)
    return LORA_NEVER if start is None else start


def make_sequences(request_id: str, ids: list[int], params: SamplingParams, lora_key: str | None,
                   cache_id: str | None, fairness_key: str | None, weight: float,
                   grammar_of, start: int = 0, base_id: str | None = None,
                   tokenizer=None) -> list[Sequence]:
    """The request's ``best_of`` sequences: the first computes the prompt, the others fork
    from it once it is computed (``pending_forks``). ``grammar_of(spec)``: a fresh matcher;
    ``start``: where the adapter starts (:func:`lora_start`), ``base_id``: the base model's
    prefix-cache identity (the blocks before ``start`` are the base's); ``tokenizer``: the
    adapter's own (``Sequence.tokenizer``), None for the base's."""
    if start and cache_id is not None:
        cache_id = f"{cache_id}@{start}"  # the KV of the block holding the start depends on it
    seqs = []
    for i in range(params.best_of):
        seq = Sequence(request_id, i, ids, params, lora_key, adapter_id=cache_id,
                       lora_start=start, base_cache_id=base_id,
                       fairness_key=fairness_key, fairness_weight=weight, tokenizer=tokenizer)
        if params.prompt_logprobs is not None and len(ids) == 1:
            seq.prompt_logprobs = [None]
        if params.structured_outputs is not None:
            seq.grammar = grammar_of(params.structured_outputs)
        if params.seed is not None:
            seq.generator = torch.Generator().manual_seed(params.seed + i * 1_000_003)
        seqs.append(seq)
    seqs[0].pending_forks = seqs[1:]
    return seqs
