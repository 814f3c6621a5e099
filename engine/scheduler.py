"""Continuous-batching scheduler: which sequences run in the next step.

A step is a token budget (``max_num_batched_tokens``), filled as in vLLM V1: every
running decode first (one token each), preempting the newest running sequences
(recompute later) when KV blocks run out; then the next chunk of prompts that are
part-way through their prefill; then waiting sequences in the order the
:class:`~loramux.engine.fairness.FairnessPolicy` gives (fair share across fairness keys
by default, or FIFO) while the budget, ``max_num_seqs``, free blocks and the adapters
allow; the policy also picks whom to preempt and is charged every scheduled token. With
chunked prefill a prompt longer than what is left of the budget takes what is left and
continues next step.

Adapters under slot pressure follow :class:`~loramux.engine.lora.admission.SlotAdmission`
(its docstring holds the policy and the bound on a sequence's wait for a slot). A waiting
sequence starts after its longest prefix found in the KV cache's prefix cache.
It knows nothing of the model, logits, grammars or text: it hands a plain-data
:class:`SchedulerOutput` to the runner and takes the sample phase's :class:`SampledOutput`
(each sequence's new token ids and whether a stop condition hit) back in
:meth:`Scheduler.update_from_output`, where the rows' sequences advance their KV, fork and
finish, as in vLLM v1 and nano-vllm. It alone moves a sequence between waiting, running and
finished.
"""

from __future__ import annotations

import logging
from collections import deque

from loramux.engine.block_manager import KVCacheManager
from loramux.engine.config import SchedulerConfig
from loramux.engine.fairness import DECODE_COST, FairnessPolicy, make_policy
from loramux.engine.lora.admission import AdapterGate, SlotAdmission
from loramux.engine.sequence import Sequence, SequenceStatus
from loramux.engine.spec_decode.drafter import Drafter
from loramux.engine.step_budget import MIN_CHUNK_TOKENS, StepBudget, StepLimits, StepShape
from loramux.engine.step_data import SampledOutput, SampledSeq, SchedulerOutput, StepOutcome
from loramux.engine.step_plan import StepPlan

logger = logging.getLogger(__name__)


class Scheduler:
    """Decodes first, chunked prefills, policy-ordered admission, newest-first preemption,
    bounded adapter diversity."""

    def __init__(
        self,
        config: SchedulerConfig,
        kv: KVCacheManager,
        max_model_len: int,
        adapters: AdapterGate | None = None,
        policy: FairnessPolicy | None = None,
        *,
        drafter: Drafter | None = None,
    ) -> None:
        """``adapters``: the adapter slots admission asks (None: adapter requests wait; it
        also hears the running sequences' adapters after every change, ``note_running``);
        ``drafter``: speculative decoding's drafts for decode rows (None = off)."""
        self.drafter = drafter
        self.config = config
        self.kv = kv
        self.max_model_len = max_model_len
        self.max_num_batched_tokens = config.token_budget(max_model_len)
        self.adapters = adapters
        self.slot_admission = SlotAdmission(adapters, config.starvation_steps)
        # A key may displace another's running sequence once it is behind by more than one
        # full decode step's charge: small enough that a newcomer beside a flood that holds
        # every slot waits about a step, large enough that two busy keys do not swap
        # sequences (and recompute them) every step.
        slack = DECODE_COST * config.max_num_seqs
        self.policy = policy or make_policy(config.fairness_policy, slack)
        self._full_slack = slack
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.seqs: dict[int, Sequence] = {}
        """Every sequence queued or running, by id (rows of a plan name them so)."""
        self.num_preemptions = 0
        self.budget = StepBudget(config.target_itl_ms, target_ttft_ms=config.target_ttft_ms,
                                 token_budget=self.max_num_batched_tokens) if config.enable_step_budget else None
        """The step-time budget (None = token/sequence limits only)."""

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
        self.seqs[seq.seq_id] = seq

    def add_fork(self, seq: Sequence) -> None:
        """Run a sequence forked from a running one (its blocks already shared)."""
        seq.status = SequenceStatus.RUNNING
        self.policy.on_add(seq)
        self.running.append(seq)
        self.seqs[seq.seq_id] = seq

    def finish(self, seq: Sequence) -> None:
        """Drop a finished or aborted sequence and free its blocks at once (the engine calls
        it to abort one; the step's own finishes happen in :meth:`update_from_output`)."""
        self._finish(seq)
        self._note_running()

    def _finish(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
            self.policy.on_finish(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
            self.policy.on_finish(seq)
        self.kv.free(seq)
        seq.status = SequenceStatus.FINISHED
        self.seqs.pop(seq.seq_id, None)

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
        plan = StepPlan(self._limits(), self.max_num_batched_tokens, self.config.enable_chunked_prefill)
        self._schedule_running(plan)
        self._continue_prefills(plan)
        if not plan.preempted:
            self._admit_waiting(plan)
        for s in plan.items:
            self.policy.charge(s.seq, s.num_new_tokens, s.is_prefill)
        self._note_running()
        return plan.output()

    # --- after the model ran and its rows were sampled ----------------------------------
    def update_from_output(self, plan: SchedulerOutput, sampled: SampledOutput) -> StepOutcome:
        """Apply a step's sampled tokens to its sequences; called once per step, after the
        sample phase. Every row advances its computed tokens (the KV blocks that became full
        join the prefix cache); a row whose prompt is now computed forks its pending ``n`` /
        ``best_of`` siblings (sharing its blocks; they sampled its row); a verify row keeps the
        KV of its accepted drafts only; sequences whose stop condition hit finish and free
        their blocks. A failed request's rows are left as they were (the engine ends it)."""
        outcome = StepOutcome(failed=dict(sampled.failed), error=sampled.error)
        if sampled.error is not None:
            return outcome
        took = {s.seq_id: s for s in sampled.seqs}
        for row in plan.scheduled:
            if row.request_id in outcome.failed:
                continue
            seq = self.seqs[row.seq_id]
            if row.num_draft_tokens:
                if row.seq_id in took:
                    self._settle_verified(seq, took[row.seq_id])
                continue
            seq.num_computed_tokens += row.num_new_tokens
            self.kv.register_computed(seq)
            if row.seq_id not in took:
                continue  # a prompt chunk: nothing was sampled
            for child in seq.pending_forks:
                self.kv.fork(seq, child)
                self.add_fork(child)
                outcome.num_forks += 1
            seq.pending_forks = []
        advanced: dict[str, None] = {}
        for s in sampled.seqs:
            seq = self.seqs.get(s.seq_id)
            if seq is None or seq.request_id in outcome.failed:
                continue
            if s.finish_reason is not None:
                self._finish(seq)
            advanced[seq.request_id] = None
        outcome.advanced = list(advanced)
        self._note_running()
        return outcome

    def _settle_verified(self, seq: Sequence, took: SampledSeq) -> None:
        """A verify row's sequence after acceptance: its last token and the accepted drafts'
        KV count, the blocks only rejected drafts used go back to the pool."""
        if self.drafter is not None:
            self.drafter.record(seq, took.num_drafted, took.num_accepted)
        if took.finish_reason is not None:
            return  # finished below: its blocks go back whole
        seq.num_computed_tokens += 1 + took.num_accepted
        self.kv.trim(seq)
        self.kv.register_computed(seq)

    def _note_running(self) -> None:
        """Tell the adapter gate which adapters the running sequences use (never evicted)."""
        if self.adapters is not None:
            self.adapters.note_running({s.lora_key for s in self.running if s.lora_key is not None})

    def _draft(self, seq: Sequence, spare: int, ratio: float) -> list[int]:
        """Drafts for ``seq``'s decode row within ``spare`` tokens of the step's budget, and
        only when its blocks can hold them beside the row's own token."""
        if self.drafter is None or spare <= 0:
            return []
        drafts = self.drafter.draft(seq, spare, ratio)
        if drafts and not self.kv.can_allocate(seq, 1 + len(drafts)):
            return []
        return drafts

    def _schedule_running(self, plan: StepPlan) -> None:
        """Decode every running sequence that has its prompt computed (oldest first),
        preempting the policy's victims (FIFO: the newest) when blocks run out."""
        kept: list[Sequence] = []
        queue = list(self.running)  # oldest first
        limits = plan.limits
        # drafts take what the step's token budget leaves beside one token per decode
        num_decodes = sum(1 for s in queue if self._is_decode(s))
        spare = self.max_num_batched_tokens - num_decodes
        ratio = limits.draft_cost_ratio
        if limits.prefill_tokens is not None:
            # the step budget caps prompt tokens (the ITL target): drafts cost what prompt tokens
            # cost and share the cap with them, leaving prompts (if any) their minimum chunk
            prompts = bool(self.waiting) or num_decodes < len(queue)
            room = limits.prefill_tokens - (MIN_CHUNK_TOKENS if prompts else 0)
            spare = min(spare, int(room / limits.draft_weight))
        while queue:
            seq = queue.pop(0)
            if not limits.runs(seq):
                kept.append(seq)  # prefilling, or a decode the step budget rotates out
                continue
            if seq.num_computed_tokens < seq.num_tokens - 1:
                kept.append(seq)  # still prefilling: _continue_prefills plans it
                continue
            drafts = self._draft(seq, spare, ratio)
            while not self.kv.can_allocate(seq, 1):
                victim = self.policy.victim([*kept, seq, *queue])
                if victim in queue:
                    queue.remove(victim)
                elif victim is not seq:
                    kept.remove(victim)
                    plan.drop(victim)
                self._preempt(victim, plan)
                if victim is seq:
                    break
            else:
                self.kv.allocate(seq, 1 + len(drafts), plan.copies)
                plan.add(seq, 1, drafts)
                spare -= len(drafts)
                kept.append(seq)
        self.running = [s for s in kept if s.status is SequenceStatus.RUNNING]

    def _continue_prefills(self, plan: StepPlan) -> None:
        """Give the next chunk to running sequences whose prompt is part-way computed."""
        for seq in list(self.running):
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted below for an older prompt
            budget = plan.room(seq)
            if seq.num_computed_tokens >= seq.num_tokens - 1 or budget <= 0:
                continue
            n = plan.chunk(seq, seq.num_tokens - seq.num_computed_tokens, budget)
            # partial prefills could hold every block between them: the newest make room
            while n and not self.kv.can_allocate(seq, n) and self.running[-1] is not seq:
                victim = self.running.pop()
                plan.drop(victim)
                self._preempt(victim, plan)
            if n == 0 or not self.kv.can_allocate(seq, n):
                continue
            self.kv.allocate(seq, n, plan.copies)
            plan.add(seq, n)

    def _preempt(self, seq: Sequence, plan: StepPlan, fair_share: bool = False) -> None:
        mine = set(seq.block_table)
        plan.copies = [c for c in plan.copies if c[1] not in mine]
        self.kv.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
        plan.preempted.append(seq)
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

    def _admit_waiting(self, plan: StepPlan) -> None:
        order = self.policy.order(self.waiting)
        fair = self.config.fairness_policy == "vtc"
        for victim in self.slot_admission.plan(order, self.running, fair_order=fair):
            # a closed adapter that did not drain in time: its slot goes to a starving one
            self.running.remove(victim)
            plan.drop(victim)
            self._preempt(victim, plan, fair_share=True)
        in_use = {s.lora_key for s in self.running if s.lora_key is not None}
        admitted: list[Sequence] = []
        max_seqs = self.config.max_num_seqs

        def has_place(seq: Sequence) -> bool:
            return len(self.running) + len(admitted) < max_seqs and plan.room(seq) > 0

        for seq in order:
            if not self._make_room(seq, plan, lambda s=seq: has_place(s)):
                break
            if not self.slot_admission.allows(seq, in_use):
                seq.skipped_steps += 1  # its adapter's age (see SlotAdmission)
                continue
            cached = self.kv.lookup_prefix(seq)
            need = seq.num_tokens - len(cached) * self.kv.block_size
            want = min(need, self.max_num_batched_tokens)
            self._make_room(seq, plan, lambda w=want, s=seq: plan.room(s) >= w)  # else a chunk
            n = plan.chunk(seq, need, plan.room(seq))
            # a preempted sequence that grew past the token budget is recomputed alone
            if n == 0 and not plan.items and need > self.max_num_batched_tokens:
                n = need
            fits = lambda s=seq, c=cached, k=n: self.kv.can_allocate_with_prefix(s, c, k)  # noqa: E731
            if n == 0 or not self._make_room(seq, plan, fits):
                break
            self.kv.take_prefix(seq, cached)
            self.kv.allocate(seq, n, plan.copies)
            seq.status = SequenceStatus.RUNNING
            seq.skipped_steps = 0
            admitted.append(seq)
            plan.add(seq, n)
            if seq.lora_key is not None:
                in_use.add(seq.lora_key)
        for seq in admitted:
            self.waiting.remove(seq)
        self.running.extend(admitted)

    # --- step-time budget --------------------------------------------------------------
    def _limits(self) -> StepLimits:
        """The step budget's limits for the next step (uncapped without a budget); sets the
        fairness policy's slack to one step's charge of the rows that run."""
        decodes, prefills = [], []
        for s in self.running:
            (decodes if self._is_decode(s) else prefills).append(s)
        prompts = {s.fairness_key for s in self.waiting} | {s.fairness_key for s in prefills}
        adapters = len({s.lora_key for s in self.running if s.lora_key is not None})
        if self.budget is None:
            return StepLimits.uncapped(len(decodes), adapters)
        limits = self.budget.plan(decodes, prompts, adapters, fair=self.config.fairness_policy == "vtc",
                                  prompts=[*prefills, *self.slot_admission.ready(self.waiting)])
        capped = limits.decode is not None  # slack: one full step's charge of this step
        self.policy.slack = DECODE_COST * len(limits.decode) if capped else self._full_slack
        return limits

    @staticmethod
    def _is_decode(seq: Sequence) -> bool:
        """True when ``seq``'s prompt is computed: its next row decodes one token."""
        return seq.num_computed_tokens >= seq.num_tokens - 1

    def set_objectives(self, key: str | None, ttft_ms: float | None, itl_ms: float | None) -> None:
        """Fairness key ``key``'s own goodput objectives (None: the engine's targets)."""
        if self.budget is not None:
            self.budget.objectives.set(key, ttft_ms, itl_ms)

    def itl_target(self) -> float | None:
        """The inter-token latency target now (seconds; None: no step budget, or not known
        yet)."""
        return self.budget.itl_target() if self.budget is not None else None

    def observe_step(self, plan: SchedulerOutput, seconds: float, extra_rows: int = 0) -> None:
        """Feed the step budget's cost model the measured wall time of ``plan``'s step;
        ``extra_rows``: sequences sampled beyond the plan's rows (forks of ``n`` siblings)."""
        if self.budget is None or plan.is_empty:
            return
        shape = StepShape(plan.num_decode_rows + extra_rows, plan.num_prefill_tokens,
                          plan.num_adapters, plan.num_draft_tokens)
        self.budget.observe(shape, seconds)

    def _make_room(self, seq: Sequence, plan: StepPlan, fits) -> bool:
        """True once ``fits()``, preempting the running sequences the policy displaces for
        waiting ``seq`` (fair share: a key far ahead yields to one behind)."""
        while not fits():
            victim = self.policy.displace(seq, self.running)
            if victim is None:
                return False
            self.running.remove(victim)
            plan.drop(victim)
            self._preempt(victim, plan, fair_share=True)
        return True
