"""The step the scheduler is planning: live sequences and how many tokens each computes this
step, counted as rows are added and dropped; :meth:`StepPlan.output` turns it into the
plain-data :class:`~loramux.engine.step_data.SchedulerOutput` the runner gets."""

from __future__ import annotations

from loramux.engine.sequence import Sequence
from loramux.engine.step_budget import StepLimits
from loramux.engine.step_data import ScheduledRow, SchedulerOutput


class PlannedRow:
    """A sequence and how many of its tokens are computed this step (planning only)."""

    __slots__ = ("seq", "num_new_tokens", "is_prefill", "drafts")

    def __init__(self, seq: Sequence, num_new_tokens: int, drafts: list[int] | None = None) -> None:
        self.seq = seq
        self.drafts = drafts or []  # a verify row: the last token, then these drafts
        self.num_new_tokens = num_new_tokens + len(self.drafts)
        self.is_prefill = not self.drafts and (
            num_new_tokens > 1 or seq.num_computed_tokens < seq.num_tokens - 1)

    def row(self) -> ScheduledRow:
        seq, n = self.seq, self.num_new_tokens
        start = seq.num_computed_tokens
        prompt_logits = 0
        if (n > 1 and not self.drafts and seq.params.prompt_logprobs is not None
                and seq.prompt_logprobs is None):
            prompt_logits = seq.num_prompt_tokens - 1
        ids = seq.token_ids[start : start + n] + self.drafts
        return ScheduledRow(seq.request_id, seq.seq_id, n, start, ids,
                            list(seq.block_table), seq.lora_key, self.is_prefill, prompt_logits,
                            seq.num_prompt_tokens, len(self.drafts), seq.lora_start)


class StepPlan:
    """The step being planned under ``limits``: live sequences, counted as they are added
    and dropped."""

    def __init__(self, limits: StepLimits | None = None, max_num_batched_tokens: int = 1 << 30,
                 chunked_prefill: bool = True) -> None:
        self.limits = limits or StepLimits()
        self.max_num_batched_tokens = max_num_batched_tokens
        self.chunked_prefill = chunked_prefill
        self.items: list[PlannedRow] = []
        self.preempted: list[Sequence] = []
        self.copies: list[tuple[int, int]] = []
        self.num_tokens = 0
        self.num_prefill_tokens = 0
        self.num_draft_tokens = 0

    def add(self, seq: Sequence, num_new_tokens: int, drafts: list[int] | None = None) -> None:
        item = PlannedRow(seq, num_new_tokens, drafts)
        self.items.append(item)
        self.num_tokens += item.num_new_tokens
        self.num_draft_tokens += len(item.drafts)
        if item.is_prefill:
            self.num_prefill_tokens += num_new_tokens

    def room(self, seq: Sequence | None = None) -> int:
        """Tokens of the step's budget not yet planned; for a prompt (``seq``) that can be
        chunked, also within the step budget's prompt-token cap (drafts counted at their
        weight in prompt tokens)."""
        left = self.max_num_batched_tokens - self.num_tokens
        cap = self.limits.prefill_tokens
        if cap is None or (seq is not None and not self.chunkable(seq)):
            return left
        drafts = int(self.num_draft_tokens * self.limits.draft_weight + 0.999)
        return min(left, cap - self.num_prefill_tokens - drafts)

    def chunkable(self, seq: Sequence) -> bool:
        """True when ``seq``'s prompt may be computed in chunks (prompt logprobs need it whole)."""
        return self.chunked_prefill and seq.params.prompt_logprobs is None

    def chunk(self, seq: Sequence, need: int, budget: int) -> int:
        """All ``need`` tokens when they fit ``budget``; a chunk of it when ``seq`` is
        :meth:`chunkable`; else 0 (not this step)."""
        if need <= budget:
            return need
        return budget if self.chunkable(seq) else 0

    def drop(self, seq: Sequence) -> None:
        """Take a preempted sequence's row out of the step."""
        for item in [i for i in self.items if i.seq is seq]:
            self.items.remove(item)
            self.num_tokens -= item.num_new_tokens
            self.num_draft_tokens -= len(item.drafts)
            if item.is_prefill:
                self.num_prefill_tokens -= item.num_new_tokens

    def output(self) -> SchedulerOutput:
        return SchedulerOutput([i.row() for i in self.items], [s.seq_id for s in self.preempted],
                               self.copies, self.limits)
