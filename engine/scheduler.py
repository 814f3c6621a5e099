"""Continuous-batching scheduler: which sequences run in the next step.

A step is a token budget (``max_num_batched_tokens``), filled as in vLLM V1: every
running decode first (one token each), preempting the newest running sequences
(recompute later) when KV blocks run out; then the next chunk of prompts that are
part-way through their prefill; then waiting sequences in the order the
:class:`~loramux.engine.fairness.AdmissionPolicy` gives (fair share across fairness keys
by default, or FIFO) while the budget, ``max_num_seqs``, free blocks and the adapters
allow; the policy also picks whom to preempt and is charged every scheduled token. With
chunked prefill a prompt longer than what is left of the budget takes what is left and
continues next step.

Adapters under slot pressure (:class:`~loramux.engine.lora.admission.AdapterAdmission`):
an adapter with running or queued sequences keeps its slot; free slots go to the waiting
adapters with the most queued sequences (resident ones first, loading ones do not hold up
the batch, the next ones are prefetched); an adapter skipped ``starvation_steps`` steps is
starving and ranks first, and when no slot is free the busy adapter with the least queued
work stops admitting, then is preempted ``starvation_steps`` later: a sequence whose adapter
is loaded starts within ``2 * starvation_steps + 2`` steps of its first skip. A waiting
sequence starts after its longest prefix found in the KV cache's prefix cache.
It knows nothing of the model: it hands a plain-data :class:`SchedulerOutput` to
the runner.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field

from loramux.engine.block_manager import KVCacheManager
from loramux.engine.config import SchedulerConfig
from loramux.engine.fairness import DECODE_COST, AdmissionPolicy, make_policy
from loramux.engine.lora.admission import AdapterAdmission, AdapterGate
from loramux.engine.sequence import Sequence, SequenceStatus
from loramux.engine.step_budget import StepBudget, StepShape

logger = logging.getLogger(__name__)


@dataclass
class ScheduledSeq:
    """A sequence and how many of its tokens are computed this step."""

    seq: Sequence
    num_new_tokens: int

    @property
    def is_prefill(self) -> bool:
        return self.num_new_tokens > 1 or self.seq.num_computed_tokens < self.seq.num_tokens - 1


@dataclass
class SchedulerOutput:
    """The plan of one step (plain data for the runner)."""

    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)
    """(source, destination) KV blocks to copy before the step (copy-on-write)."""

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    """Decodes first, chunked prefills, policy-ordered admission, newest-first preemption,
    bounded adapter diversity."""

    def __init__(
        self,
        config: SchedulerConfig,
        kv: KVCacheManager,
        max_model_len: int,
        adapters: AdapterGate | None = None,
        policy: AdmissionPolicy | None = None,
    ) -> None:
        self.config = config
        self.kv = kv
        self.max_model_len = max_model_len
        self.max_num_batched_tokens = config.token_budget(max_model_len)
        self.adapters = adapters
        self.admission = AdapterAdmission(adapters, config.starvation_steps)
        # A key may displace another's running sequence once it is behind by more than one
        # full decode step's charge: small enough that a newcomer beside a flood that holds
        # every slot waits about a step, large enough that two busy keys do not swap
        # sequences (and recompute them) every step.
        slack = DECODE_COST * config.max_num_seqs
        self.policy = policy or make_policy(config.fairness_policy, slack)
        self._full_slack = slack
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.budget = StepBudget(config.target_step_ms) if config.enable_step_budget else None
        """The step-time budget (None = token/sequence limits only)."""
        self._prefill_cap: int | None = None  # this step's prompt tokens (step budget)

    # --- queue ---------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        """Queue a new sequence; called by the engine when a request arrives."""
        if seq.num_tokens > self.max_model_len:
            raise ValueError(
                f"prompt is {seq.num_tokens} tokens, longer than max_model_len "
                f"({self.max_model_len})"
            )
        max_tokens = seq.params.max_tokens or self.max_model_len
        longest = min(seq.num_tokens + max_tokens, self.max_model_len)
        # the last token is sampled, never computed; alone, the sequence must always fit
        if self.kv.blocks_for(max(longest - 1, seq.num_tokens)) > self.kv.pool.num_blocks:
            raise ValueError(
                f"a sequence of up to {longest} tokens (prompt of {seq.num_tokens}) does not fit "
                f"in the KV cache ({self.kv.pool.num_blocks} blocks of {self.kv.block_size}); "
                f"lower max_tokens or give the KV cache more memory"
            )
        must_fit = not self.config.enable_chunked_prefill or seq.params.prompt_logprobs is not None
        if must_fit and seq.num_tokens > self.max_num_batched_tokens:
            raise ValueError(
                f"prompt is {seq.num_tokens} tokens, more than max_num_batched_tokens "
                f"({self.max_num_batched_tokens}): it could never be scheduled"
            )
        seq.status = SequenceStatus.WAITING
        self.policy.on_add(seq)
        self.waiting.append(seq)

    def add_fork(self, seq: Sequence) -> None:
        """Run a sequence forked from a running one (its blocks already shared)."""
        seq.status = SequenceStatus.RUNNING
        self.policy.on_add(seq)
        self.running.append(seq)

    def finish(self, seq: Sequence) -> None:
        """Drop a finished or aborted sequence and free its blocks at once."""
        if seq in self.running:
            self.running.remove(seq)
            self.policy.on_finish(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
            self.policy.on_finish(seq)
        self.kv.free(seq)
        seq.status = SequenceStatus.FINISHED

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    # --- planning ------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Plan the next step; mutates block tables and queues.

        Every running decode first (one token each), then running prompts that are
        part-way through their prefill, then waiting sequences in the order the
        admission policy gives, each taking as much of the remaining token budget as
        it needs (a chunk of it when chunked prefill is on)."""
        out = SchedulerOutput()
        self._prefill_cap = None
        self._schedule_running(out)
        self._continue_prefills(out)
        if not out.preempted:
            self._admit_waiting(out)
        for s in out.scheduled:
            self.policy.charge(s.seq, s.num_new_tokens, s.is_prefill)
        return out

    def _chunk(self, seq: Sequence, budget: int) -> int:
        """Tokens of ``seq``'s uncomputed prompt to compute now (0 = not this step)."""
        return self._chunk_of(seq, seq.num_tokens - seq.num_computed_tokens, budget)

    def _schedule_running(self, out: SchedulerOutput) -> None:
        """Decode every running sequence that has its prompt computed (oldest first),
        preempting the policy's victims (FIFO: the newest) when blocks run out."""
        kept: list[Sequence] = []
        queue = list(self.running)  # oldest first
        run_now = self._budget_decodes()
        while queue:
            seq = queue.pop(0)
            if seq.num_computed_tokens < seq.num_tokens - 1:
                kept.append(seq)  # still prefilling: _continue_prefills plans it
                continue
            if run_now is not None and id(seq) not in run_now:
                kept.append(seq)  # the step budget rotates it out of this step
                continue
            while not self.kv.can_allocate(seq, 1):
                victim = self.policy.victim([*kept, seq, *queue])
                if victim in queue:
                    queue.remove(victim)
                elif victim is not seq:
                    kept.remove(victim)
                    out.scheduled = [s for s in out.scheduled if s.seq is not victim]
                self._preempt(victim, out)
                if victim is seq:
                    break
            else:
                self.kv.allocate(seq, 1, out.copies)
                out.scheduled.append(ScheduledSeq(seq, 1))
                kept.append(seq)
        self.running = [s for s in kept if s.status is SequenceStatus.RUNNING]

    def _continue_prefills(self, out: SchedulerOutput) -> None:
        """Give the next chunk to running sequences whose prompt is part-way computed."""
        for seq in list(self.running):
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted below for an older prompt
            budget = self._budget(out, seq)
            if seq.num_computed_tokens >= seq.num_tokens - 1 or budget <= 0:
                continue
            n = self._chunk(seq, budget)
            # partial prefills could hold every block between them: the newest make room
            while n and not self.kv.can_allocate(seq, n) and self.running[-1] is not seq:
                victim = self.running.pop()
                out.scheduled = [s for s in out.scheduled if s.seq is not victim]
                self._preempt(victim, out)
            if n == 0 or not self.kv.can_allocate(seq, n):
                continue
            self.kv.allocate(seq, n, out.copies)
            out.scheduled.append(ScheduledSeq(seq, n))

    def _preempt(self, seq: Sequence, out: SchedulerOutput, fair_share: bool = False) -> None:
        mine = set(seq.block_table)
        out.copies = [c for c in out.copies if c[1] not in mine]
        self.kv.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
        out.preempted.append(seq)
        if fair_share:
            logger.info("Sequence %s of request %s is preempted (recompute) for a fairness key with "
                        "a smaller share of the tokens served", seq.seq_id, seq.request_id)
            return
        logger.warning(
            "Sequence %s of request %s is preempted by RECOMPUTE mode because there is not "
            "enough KV cache space. This can affect the end-to-end performance. Increase "
            "kv_cache_memory or gpu_memory_utilization to provide more KV cache memory. "
            "total_num_cumulative_preemption=%d",
            seq.seq_id, seq.request_id, self.num_preemptions,
        )

    def _admit_waiting(self, out: SchedulerOutput) -> None:
        for victim in self.admission.plan(self.waiting, self.running):
            # a closed adapter that did not drain in time: its slot goes to a starving one
            self.running.remove(victim)
            out.scheduled = [s for s in out.scheduled if s.seq is not victim]
            self._preempt(victim, out, fair_share=True)
        in_use = {s.lora_key for s in self.running if s.lora_key is not None}
        admitted: list[Sequence] = []
        max_seqs = self.config.max_num_seqs

        def has_place(seq: Sequence) -> bool:
            return len(self.running) + len(admitted) < max_seqs and self._budget(out, seq) > 0

        for seq in self.policy.order(self.waiting):
            if not self._make_room(seq, out, lambda s=seq: has_place(s)):
                break
            if not self.admission.allows(seq, in_use):
                seq.skipped_steps += 1  # its adapter's age (see AdapterAdmission)
                continue
            cached = self.kv.lookup_prefix(seq)
            need = seq.num_tokens - len(cached) * self.kv.block_size
            want = min(need, self.max_num_batched_tokens)
            self._make_room(seq, out, lambda w=want, s=seq: self._budget(out, s) >= w)  # else a chunk
            n = self._chunk_of(seq, need, self._budget(out, seq))
            # a preempted sequence that grew past the token budget is recomputed alone
            if n == 0 and not out.scheduled and need > self.max_num_batched_tokens:
                n = need
            fits = lambda s=seq, c=cached, k=n: self.kv.can_allocate_with_prefix(s, c, k)  # noqa: E731
            if n == 0 or not self._make_room(seq, out, fits):
                break
            self.kv.take_prefix(seq, cached)
            self.kv.allocate(seq, n, out.copies)
            seq.status = SequenceStatus.RUNNING
            seq.skipped_steps = 0
            admitted.append(seq)
            out.scheduled.append(ScheduledSeq(seq, n))
            if seq.lora_key is not None:
                in_use.add(seq.lora_key)
        for seq in admitted:
            self.waiting.remove(seq)
        self.running.extend(admitted)

    def _budget(self, out: SchedulerOutput, seq: Sequence | None = None) -> int:
        """Tokens of the step's budget not yet planned; for a prompt (``seq``) that can be
        chunked, also within the step-time budget's prompt tokens."""
        left = self.max_num_batched_tokens - out.num_batched_tokens
        if self._prefill_cap is None or (seq is not None and not self._chunkable(seq)):
            return left
        prefill = sum(s.num_new_tokens for s in out.scheduled if s.is_prefill)
        return min(left, self._prefill_cap - prefill)

    def _chunkable(self, seq: Sequence) -> bool:
        return self.config.enable_chunked_prefill and seq.params.prompt_logprobs is None

    # --- step-time budget --------------------------------------------------------------
    def _budget_decodes(self) -> set[int] | None:
        """Ids of the running decodes the step budget lets in (None = all); sets this
        step's prompt-token cap."""
        if self.budget is None:
            return None
        decodes = [s for s in self.running if s.num_computed_tokens >= s.num_tokens - 1]
        prompts = {s.fairness_key for s in self.waiting}
        prompts |= {s.fairness_key for s in self.running if s.num_computed_tokens < s.num_tokens - 1}
        adapters = len({s.lora_key for s in self.running if s.lora_key is not None})
        limits = self.budget.plan(decodes, prompts, adapters, fair=self.config.fairness_policy == "vtc")
        self._prefill_cap = limits.prefill_tokens
        capped = len(limits.decode) < len(decodes)  # slack: one full step's charge of this step
        self.policy.slack = DECODE_COST * len(limits.decode) if capped else self._full_slack
        return None if len(limits.decode) == len(decodes) else {id(s) for s in limits.decode}

    def observe_step(self, plan: SchedulerOutput, seconds: float, extra_rows: int = 0) -> None:
        """Feed the step budget's cost model the measured wall time of ``plan``'s step;
        ``extra_rows``: sequences sampled beyond the plan's rows (forks of ``n`` siblings)."""
        if self.budget is None or plan.is_empty:
            return
        prefill = sum(s.num_new_tokens for s in plan.scheduled if s.is_prefill)
        decode = sum(1 for s in plan.scheduled if not s.is_prefill) + extra_rows
        adapters = len({s.seq.lora_key for s in plan.scheduled if s.seq.lora_key is not None})
        self.budget.observe(StepShape(decode, prefill, adapters), seconds)

    def _make_room(self, seq: Sequence, out: SchedulerOutput, fits) -> bool:
        """True once ``fits()``, preempting the running sequences the policy displaces for
        waiting ``seq`` (fair share: a key far ahead yields to one behind)."""
        while not fits():
            victim = self.policy.displace(seq, self.running)
            if victim is None:
                return False
            self.running.remove(victim)
            out.scheduled = [s for s in out.scheduled if s.seq is not victim]
            self._preempt(victim, out, fair_share=True)
        return True

    def _chunk_of(self, seq: Sequence, need: int, budget: int) -> int:
        """All ``need`` tokens when they fit ``budget``; a chunk of it when chunked prefill is on
        (never for prompt logprobs, which need the whole prompt in one step); else 0."""
        if need <= budget:
            return need
        if self.config.enable_chunked_prefill and seq.params.prompt_logprobs is None:
            return budget
        return 0
