"""Which decode rows draft, how many tokens, and what came of it.

Called by the scheduler while it plans a step (:meth:`Drafter.draft`) and after the step's
verification (:meth:`Drafter.record`), on the engine thread. A sequence drafts unless it
has a grammar (structured output: guided rows are neither drafted nor verified with the
grammar), or its acceptance stayed low: after ``min_rounds`` verify steps whose smoothed
share of accepted draft tokens is below ``acceptance_floor``, it stops drafting for a back-off
(8 decode steps, doubling each time up to 256) and then probes again. Drafts never run past
``max_tokens`` or ``max_model_len``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from loramux.engine.sequence import Sequence
from loramux.engine.spec_decode.config import SpeculativeConfig
from loramux.engine.spec_decode.ngram import TokenBuffer, propose

_SMOOTHING = 0.5
"""Weight of the newest verify step in the smoothed acceptance."""
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

    __slots__ = ("buffer", "rounds", "smoothed", "off_steps", "backoff")

    def __init__(self) -> None:
        self.buffer = TokenBuffer()
        self.rounds = 0  # verify steps since drafting last (re)started
        self.smoothed = 1.0
        self.off_steps = 0  # decode steps left without drafting
        self.backoff = _FIRST_BACKOFF


class Drafter:
    """Ngram drafts for decode rows, and the per-adapter acceptance counters."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.counts: dict[str | None, SpecCounts] = {}
        """Adapter key (None = base model) -> counters."""

    def draft(self, seq: Sequence, max_tokens: int) -> list[int]:
        """Draft tokens for ``seq``'s next decode row, at most ``max_tokens`` (what the step's
        token budget leaves); called once per decode row while the step is planned."""
        if seq.grammar is not None:
            return []
        state = seq.spec_state
        if state is None:
            state = seq.spec_state = SpecState()
        if state.off_steps > 0:
            state.off_steps -= 1
            return []
        cfg, p = self.config, seq.params
        k = min(cfg.num_speculative_tokens, max_tokens, self.max_model_len - seq.num_tokens - 1)
        if p.max_tokens is not None:
            k = min(k, p.max_tokens - seq.num_output_tokens - 1)  # the last token is sampled
        if k < 1:
            return []
        context = state.buffer.sync(seq.token_ids)
        return propose(context, k, cfg.prompt_lookup_min, cfg.prompt_lookup_max)

    def record(self, seq: Sequence, num_drafted: int, num_accepted: int) -> None:
        """After a verify step: count it for ``seq``'s adapter and judge ``seq``'s acceptance."""
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
        if state is None or self.config.acceptance_floor <= 0:
            return
        rate = num_accepted / num_drafted
        state.smoothed = rate if state.rounds == 0 else (
            _SMOOTHING * rate + (1 - _SMOOTHING) * state.smoothed)
        state.rounds += 1
        if state.rounds < self.config.min_rounds:
            return
        if state.smoothed < self.config.acceptance_floor:
            state.off_steps = state.backoff
            state.backoff = min(2 * state.backoff, _MAX_BACKOFF)
            state.rounds = 0
        elif state.smoothed >= 2 * self.config.acceptance_floor:
            state.backoff = _FIRST_BACKOFF

    def snapshot(self) -> dict[str, SpecCounts]:
        """A copy of the counters by adapter (``base`` = no adapter), for ``EngineStats``."""
        return {("base" if key is None else key): SpecCounts(
                    c.num_drafts, c.num_draft_tokens, c.num_accepted_tokens, list(c.accepted_per_pos))
                for key, c in self.counts.items()}
