"""Drive a :class:`Scheduler` with no model and no logits: each step's plan gets a plain-data
:class:`SampledOutput` of the token ids a test chooses, passed through the real postprocessor
(its stop checks decide which sequences stop), and the scheduler's ``update_from_output``
applies it. Tests of the sample phase itself build a :class:`ModelOutput` (:func:`model_output`)
and run it through a real :class:`OutputProcessor` (:func:`sample`)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from loramux.engine.block_manager import KVCacheManager
from loramux.engine.config import SchedulerConfig
from loramux.engine.detokenizer import Detokenizer
from loramux.engine.output_processor import OutputProcessor
from loramux.engine.postprocess import Postprocessor
from loramux.engine.sampler import Sampler, SamplerOutput
from loramux.engine.scheduler import Scheduler
from loramux.engine.sequence import Sequence
from loramux.engine.step_data import (
    ModelOutput,
    SampledOutput,
    SampledSeq,
    SchedulerOutput,
    StepOutcome,
)

VOCAB = 512
PICK = 1e4
"""The chosen token's logit (the others are 0): every sampler setting picks it."""

TokenFn = Callable[[Scheduler, int], int]


class FakeDetokenizer:
    """Token ``t`` reads `` t``."""

    apply_stop_strings = staticmethod(Detokenizer.apply_stop_strings)

    def decode_token(self, seq: Sequence, token_id: int) -> str:
        return f" {token_id}"

    def token_text(self, token_id: int, seq: Sequence | None = None) -> str:
        return str(token_id)


class NoGrammars:
    def apply(self, logits: torch.Tensor, matchers: list) -> torch.Tensor:
        raise AssertionError("no test request here has a grammar")


class BrokenLog:
    """Records the adapters marked broken."""

    def __init__(self) -> None:
        self.marked: list[tuple[str, Exception]] = []

    def mark_broken(self, key: str, error: Exception) -> None:
        self.marked.append((key, error))


def make_postprocessor(max_model_len: int, eos: set[int] | None = None) -> Postprocessor:
    return Postprocessor(FakeDetokenizer(), eos if eos is not None else set(), max_model_len)


def make_output_processor(max_model_len: int, eos: set[int] | None = None,
                          broken: BrokenLog | None = None) -> OutputProcessor:
    eos = eos if eos is not None else set()
    return OutputProcessor(
        Sampler(VOCAB, eos, torch.Generator().manual_seed(0)),
        make_postprocessor(max_model_len, eos),
        NoGrammars(),
        broken if broken is not None else BrokenLog(),
    )


def make_scheduler(config: SchedulerConfig, kv: KVCacheManager, max_model_len: int,
                   adapters=None, **kwargs) -> Scheduler:
    return Scheduler(config, kv, max_model_len, adapters, **kwargs)


def next_output_token(sched: Scheduler, seq_id: int) -> int:
    """The default pick: 101, 102, ... for a sequence's 1st, 2nd, ... output token."""
    return 101 + sched.seqs[seq_id].num_output_tokens


def sampled_output(sched: Scheduler, plan: SchedulerOutput, token: TokenFn = next_output_token,
                   eos: set[int] | None = None) -> SampledOutput:
    """The sample phase as data: each row whose prompt is now computed (and its pending
    siblings) takes ``token(sched, seq_id)``, postprocessed by the real stop checks (max
    tokens, ``max_model_len``, stop tokens, EOS ``eos``); prompt chunks take nothing."""
    post = make_postprocessor(sched.max_model_len, eos)
    took = []
    for row in plan.scheduled:
        seq = sched.seqs[row.seq_id]
        if row.num_computed_tokens + row.num_new_tokens < seq.num_tokens:
            continue
        tok = token(sched, seq.seq_id)  # the row's pick: its siblings sample the same row
        for s in (seq, *seq.pending_forks):
            post.accept(s, 0, SamplerOutput([tok], None, None, None, None))
            took.append(SampledSeq(s.seq_id, [tok], s.finish_reason))
    return SampledOutput(took)


def model_output(sched: Scheduler, plan: SchedulerOutput, token: TokenFn = next_output_token,
                 ) -> ModelOutput:
    """Logits for the plan's rows (in plan order) that pick ``token(sched, seq_id)``."""
    logits = torch.zeros(len(plan.scheduled), VOCAB)
    for i, row in enumerate(plan.scheduled):
        logits[i, token(sched, row.seq_id)] = PICK
    return ModelOutput(list(plan.scheduled), logits)


def sample(outputs: OutputProcessor, sched: Scheduler, plan: SchedulerOutput,
           out: ModelOutput) -> StepOutcome:
    """The engine's sample and update phases for a model output: ``outputs`` samples it,
    the scheduler applies the sampled tokens."""
    return sched.update_from_output(plan, outputs.sample(out, sched.seqs))


def step(sched: Scheduler, token: TokenFn = next_output_token, eos: set[int] | None = None,
         ) -> tuple[SchedulerOutput, StepOutcome]:
    """Plan a step and apply its sampled tokens to it, as the engine does."""
    plan = sched.schedule()
    outcome = sched.update_from_output(plan, sampled_output(sched, plan, token, eos))
    return plan, outcome
