"""Which decode rows draft, how many tokens, and what came of it.

Called by the scheduler while it plans a step (:meth:`Drafter.draft`) and after the step's
verification (:meth:`Drafter.record`), on the engine thread. A sequence drafts unless its
grammar constrains it (structured output: guided rows are neither drafted nor verified with
the grammar); one whose grammar waits for the end of its thought (``reasoning_end``) drafts,
and its drafts are verified position by position, masked from the token after the thought's
end on. How many tokens it drafts follows what they are worth: each sequence keeps an
estimate ``a`` of the chance that a drafted token is accepted (accepted drafts over
accepted + rejecting verify steps, decayed, the maximum-likelihood ``a`` of a geometric run),
and the i-th draft is kept only while ``a ** i`` (the chance it is accepted) exceeds the
step's *cost ratio*: what one more token costs the step over what one decode token of the
step costs (``StepLimits.draft_cost_ratio``, from the step budget's fitted cost model; about 0.1 per
row in the batch on a CPU). A sequence whose acceptance stays below the ratio stops
drafting for a back-off (8 decode steps, doubling each time up to 256) and then probes
again with one draft. Drafts never run past ``max_tokens`` or ``max_model_len``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from loramux.engine.grammar_gate import constrains
from loramux.engine.sequence import Sequence
from loramux.engine.spec_decode.config import SpeculativeConfig
from loramux.engine.spec_decode.ngram import TokenBuffer, propose

DECAY = 0.8
"""Weight of a sequence's past verify steps per new one in its acceptance estimate."""
_FIRST_BACKOFF = 8
_MAX_BACKOFF = 256


@dataclass
class SpecCounts:
    """Counters of one adapter since start (vLLM's ``spec_decode_num_*``)."""

    num_drafts: int = 0
    """Verify steps with at least one drafted token."""
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    """Drafts whose token at position i (0-based) was accepted."""

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0


class SpecState:
    """One sequence's drafting state (``Sequence.spec_state``)."""

    __slots__ = ("buffer", "accepted", "rejections", "off_steps", "backoff", "probing")

    def __init__(self) -> None:
        self.buffer = TokenBuffer()
        self.accepted = 3.0  # decayed accepted drafts (a prior of three accepted ...)
        self.rejections = 1.0  # ... and one rejecting verify step: a = 0.75 to start
        self.off_steps = 0  # decode steps left without drafting
        self.backoff = _FIRST_BACKOFF
        self.probing = False

    @property
    def acceptance(self) -> float:
        """Estimated chance that one drafted token is accepted."""
        return self.accepted / (self.accepted + self.rejections)


class Drafter:
    """Ngram drafts for decode rows, and the per-adapter acceptance counters."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.counts: dict[str | None, SpecCounts] = {}
        """Adapter key (None = base model) -> counters."""

    def draft(self, seq: Sequence, max_tokens: int, cost_ratio: float = 0.1) -> list[int]:
        """Draft tokens for ``seq``'s next decode row, at most ``max_tokens`` (what the step's
        token budget leaves), each worth more than ``cost_ratio`` (see the module doc);
        called once per decode row while the step is planned."""
        if constrains(seq.grammar):
            return []
        state = seq.spec_state
        if state is None:
            state = seq.spec_state = SpecState()
        if state.off_steps > 0:
            state.off_steps -= 1
            state.probing = state.off_steps == 0
            return []
        cfg, p = self.config, seq.params
        k = min(cfg.num_speculative_tokens, max_tokens, self.max_model_len - seq.num_tokens - 1)
        if p.max_tokens is not None:
            k = min(k, p.max_tokens - seq.num_output_tokens - 1)  # the last token is sampled
        a, worth = state.acceptance, 0
        chance = a
        while worth < k and chance > cost_ratio:
            worth += 1
            chance *= a
        if worth == 0:
            if state.probing:
                worth = 1
            else:
                state.off_steps = state.backoff
                state.backoff = min(2 * state.backoff, _MAX_BACKOFF)
                return []
        k = min(k, worth)
        if k < 1:
            return []
        context = state.buffer.sync(seq.token_ids)
        return propose(context, k, cfg.prompt_lookup_min, cfg.prompt_lookup_max)

    def record(self, seq: Sequence, num_drafted: int, num_accepted: int) -> None:
        """After a verify step: count it for ``seq``'s adapter and update ``seq``'s estimate."""
        c = self.counts.get(seq.lora_key)
        if c is None:
            c = self.counts[seq.lora_key] = SpecCounts()
        c.num_drafts += 1
        c.num_draft_tokens += num_drafted
        c.num_accepted_tokens += num_accepted
        if len(c.accepted_per_pos) < num_drafted:
            c.accepted_per_pos.extend([0] * (num_drafted - len(c.accepted_per_pos)))
        for i in range(num_accepted):
            c.accepted_per_pos[i] += 1
        state = seq.spec_state
        if state is None:
            return
        state.accepted = DECAY * state.accepted + num_accepted
        state.rejections = DECAY * state.rejections + (num_accepted < num_drafted)
        if state.probing:
            state.probing = False
        elif state.acceptance > 0.5:
            state.backoff = _FIRST_BACKOFF

    def snapshot(self) -> dict[str, SpecCounts]:
        """A copy of the counters by adapter (``base`` = no adapter), for ``EngineStats``;
        any thread (the metrics scrape) may call it while the engine thread counts."""
        return {("base" if key is None else key): SpecCounts(
                    c.num_drafts, c.num_draft_tokens, c.num_accepted_tokens, list(c.accepted_per_pos))
                for key, c in list(self.counts.items())}
