"""The plain data one engine step hands between its phases (vLLM v1's ``SchedulerOutput`` and
``ModelRunnerOutput``)::

    Scheduler.schedule()               -> SchedulerOutput  (which rows, their tokens and blocks)
    ModelRunner.execute()              -> ModelOutput      (the rows' logits, or the step's error)
    OutputProcessor.sample()           -> SampledOutput    (each sequence's new tokens, failures)
    Scheduler.update_from_output()     -> StepOutcome      (which requests advanced or failed)

No live :class:`~loramux.engine.sequence.Sequence` crosses a phase: a row names its sequence
by id and carries what the runner needs to build the step's tensors (its input token ids,
first position, block ids, adapter), so the scheduler is tested with no model and the runner
with no scheduler; only the execute and sample phases hold tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from loramux.engine.step_budget import StepLimits


@dataclass(slots=True)
class ScheduledRow:
    """One sequence's part of a step: ``num_new_tokens`` tokens computed from position
    ``num_computed_tokens`` on."""

    request_id: str
    seq_id: int
    num_new_tokens: int
    num_computed_tokens: int
    """Tokens of the sequence already in the KV cache: the row's first position."""
    token_ids: list[int]
    """The row's input tokens this step (``num_new_tokens`` of them)."""
    block_ids: list[int]
    """The sequence's block table once this step's blocks are allocated."""
    lora_key: str | None
    """The adapter of the row (None = the base model)."""
    is_prefill: bool
    """Part of a prompt (or a recompute); a decode row computes the one last token."""
    num_prompt_logits: int = 0
    """Prompt positions (0 .. P - 2) whose logits the runner returns for prompt logprobs
    (0 = none; a row asking for them carries its whole prompt)."""
    num_prompt_tokens: int = 0
    """The sequence's prompt length (the rotary of LongRoPE models depends on it)."""
    num_draft_tokens: int = 0
    """A verify row (speculative decoding): the last ``num_draft_tokens`` of ``token_ids``
    are drafts after the sequence's last token; the runner returns the logits of every
    position (``ModelOutput.draft_logits``)."""
    lora_start: int = 0
    """The first position computed with ``lora_key``'s adapter (``Sequence.lora_start``:
    an activated LoRA's positions before its invocation are the base model's)."""


@dataclass
class SchedulerOutput:
    """The plan of one step: its rows, the sequences it preempted, the copy-on-write copies."""

    scheduled: list[ScheduledRow] = field(default_factory=list)
    preempted: list[int] = field(default_factory=list)
    """Ids of the sequences preempted (recompute) while planning this step."""
    copies: list[tuple[int, int]] = field(default_factory=list)
    """(source, destination) KV blocks to copy before the step (copy-on-write)."""
    limits: StepLimits | None = None
    """The step budget's caps this step was planned under (None: no step budget)."""

    @property
    def num_batched_tokens(self) -> int:
        return sum(r.num_new_tokens for r in self.scheduled)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(r.num_new_tokens for r in self.scheduled if r.is_prefill)

    @property
    def num_draft_tokens(self) -> int:
        """Drafted tokens the verify rows compute (speculative decoding)."""
        return sum(r.num_draft_tokens for r in self.scheduled)

    @property
    def num_decode_rows(self) -> int:
        return sum(1 for r in self.scheduled if not r.is_prefill)

    @property
    def num_adapters(self) -> int:
        """Distinct adapters in the step."""
        return len({r.lora_key for r in self.scheduled if r.lora_key is not None})

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class ModelOutput:
    """What the execute phase returns: the rows in logits order and their logits, or the
    batch-level error."""

    rows: list[ScheduledRow]
    """The plan's rows in the order of ``logits`` (the runner's order)."""
    logits: torch.Tensor | None = None
    """[B, V] fp32, row i for ``rows[i]``'s last token of the step."""
    prompt_logits: dict[int, torch.Tensor] = field(default_factory=dict)
    """row -> [P - 1, V] logits of the prompt positions (prompt logprobs)."""
    draft_logits: dict[int, torch.Tensor] = field(default_factory=dict)
    """row -> [k, V] logits of a verify row's positions before its last (its last token and
    its first k - 1 drafts); the last position's logits are ``logits[row]``."""
    error: Exception | None = None
    """Set when the step failed as a whole (e.g. an allocation): its requests fail."""


@dataclass(slots=True)
class SampledSeq:
    """What one sequence took in a step."""

    seq_id: int
    token_ids: list[int]
    """Tokens appended this step: one, or a verify row's accepted drafts and the token
    sampled after them."""
    finish_reason: str | None = None
    """Set when a stop condition was hit (``stop`` / ``length``): the scheduler finishes it."""
    num_drafted: int = 0
    """A verify row's drafted tokens (0: not a verify row)."""
    num_accepted: int = 0
    """Of those, the accepted ones (their KV is kept)."""


@dataclass
class SampledOutput:
    """What the sample phase returns: per-sequence tokens in the order they were taken
    (``n`` / ``best_of`` siblings sample their parent's row), and the requests that failed."""

    seqs: list[SampledSeq] = field(default_factory=list)
    failed: dict[str, Exception] = field(default_factory=dict)
    """Request id -> why it failed in this step (a non-finite row, a sampler or
    postprocessing error, or the batch-level error): the other rows went on."""
    nonfinite_rows: list[int] = field(default_factory=list)
    """Rows of the model output whose logits held a NaN or an Inf."""
    error: Exception | None = None
    """The batch-level error of the execute phase (every request of the plan failed)."""


@dataclass
class StepOutcome:
    """What :meth:`Scheduler.update_from_output` did with a step, for the request bookkeeping
    (the engine's: error, metrics, finished requests leave)."""

    advanced: list[str] = field(default_factory=list)
    """Requests with a new token or a finished sequence, in the order they got them."""
    failed: dict[str, Exception] = field(default_factory=dict)
    """Requests that failed in this step and why (only theirs: the other rows went on); the
    caller ends them (their other sequences may be outside the step)."""
    num_forks: int = 0
    """Sequences forked (``n`` / ``best_of`` siblings) and sampled beyond the plan's rows."""
    error: Exception | None = None
    """The batch-level error when the step failed as a whole (every request in ``failed``)."""
