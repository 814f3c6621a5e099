"""Per-sequence state owned by the engine: tokens, KV blocks, status, generator."""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from loramux.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch

_seq_ids = itertools.count()

LORA_NEVER = 1 << 62
"""``Sequence.lora_start`` of an aLoRA request whose prompt holds no invocation: no position
gets the adapter (the request is the base model's)."""


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """One generated sequence (a request with ``best_of`` > 1 has several).

    ``token_ids`` holds prompt + generated tokens; ``num_computed_tokens`` of them
    have their keys and values in the KV cache.
    """

    request_id: str
    index: int
    prompt_token_ids: list[int]
    params: SamplingParams
    lora_key: str | None = None
    """Adapter of this sequence (None = the base model)."""
    adapter_id: str | None = None
    """The adapter's identity in prefix-cache keys (``LoRARequest.prefix_cache_id``;
    None = ``lora_key``)."""
    lora_start: int = 0
    """The first position computed with the adapter: 0 for a plain LoRA; an activated LoRA's
    invocation start in the prompt (``adapters.alora.activation_start``), fixed when the
    request is added (generated tokens never move it); :data:`LORA_NEVER` when the prompt
    holds no invocation. Positions before it are the base model's, in the KV cache too."""
    base_cache_id: str | None = None
    """The prefix-cache identity of the base model's blocks (``adapter_id`` without the
    adapter): that of the full blocks wholly before ``lora_start``."""
    fairness_key: str | None = None
    """Whose fair share this sequence counts against (opaque; the platform's tenant)."""
    fairness_weight: float = 1.0
    """Share weight of the request: a key's tokens are charged ``1 / weight`` each."""
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    """When its first output token was appended (monotonic; the step budget's TPOT slack)."""
    seq_id: int = field(default_factory=lambda: next(_seq_ids))
    token_ids: list[int] = field(init=False)
    block_table: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_keys: list[bytes] = field(default_factory=list)
    """Prefix-cache keys of the leading full blocks of ``token_ids`` (memo, see block_manager)."""
    num_registered_blocks: int = 0
    """Leading blocks of ``block_table`` already keyed in the prefix cache."""
    num_cached_tokens: int | None = None
    """Prompt tokens found in the prefix cache when the sequence was first admitted
    (None before; ``RequestOutput.num_cached_tokens``)."""
    pending_forks: list[Sequence] = field(default_factory=list)
    """Siblings (``best_of`` > 1) that fork from this sequence once its prompt is computed."""
    status: SequenceStatus = SequenceStatus.WAITING
    """Set by the scheduler only (queued, in the batch, done)."""
    generator: torch.Generator | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    cumulative_logprob: float = 0.0
    logprobs: list = field(default_factory=list)
    prompt_logprobs: list | None = None
    text: str = ""
    """Detokenized output so far (stop strings already cut)."""
    skipped_steps: int = 0
    """Steps this sequence waited while others were admitted (aging)."""
    num_preemptions: int = 0
    budget_ran: int = 0
    """Last step (the step budget's count) this sequence's decode row ran: a key's rows
    rotate by it when the budget caps them."""
    detok_state: object | None = None
    tokenizer: object | None = None
    """The adapter's own tokenizer when it adds tokens (``engine/adapter_tokenizers.py``);
    None: the base model's."""
    grammar: object | None = None
    """xgrammar matcher when the request has structured_outputs (a ``GatedMatcher`` when it
    waits for the end of a thought: ``grammar_gate.py``)."""
    spec_state: object | None = None
    """Speculative decoding's per-sequence state (``spec_decode/drafter.py``; None = none yet)."""

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)
        if self.adapter_id is None:
            self.adapter_id = self.lora_key

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def is_stopped(self) -> bool:
        """A stop condition hit (``finish_reason`` set by the sample phase, or an abort): the
        scheduler finishes it; true from then on."""
        return self.finish_reason is not None

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        if self.first_token_time is None:
            self.first_token_time = time.monotonic()
