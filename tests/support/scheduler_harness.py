"""Drive a :class:`Scheduler` with no model: each step's plan gets a plain-data
:class:`ModelOutput` whose logits pick the token a test chooses, and the scheduler's real
``update_from_output`` (real sampler, postprocessor and stop checks) applies it."""

from __future__ import annotations

from collections.abc import Callable

import torch

from loramux.engine.block_manager import KVCacheManager
from loramux.engine.config import SchedulerConfig
from loramux.engine.detokenizer import Detokenizer
from loramux.engine.output_processor import OutputProcessor
from loramux.engine.postprocess import Postprocessor
from loramux.engine.sampler import Sampler
from loramux.engine.scheduler import Scheduler
from loramux.engine.sequence import Sequence
from loramux.engine.step_data import ModelOutput, SchedulerOutput, StepOutcome

VOCAB = 512
PICK = 1e4
"""The chosen token's logit (the others are 0): every sampler setting picks it."""


class FakeDetokenizer:
    """Token ``t`` reads `` t``."""

    apply_stop_strings = staticmethod(Detokenizer.apply_stop_strings)

    def decode_token(self, seq: Sequence, token_id: int) -> str:
        return f" {token_id}"

    def token_text(self, token_id: int) -> str:
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


def make_output_processor(max_model_len: int, eos: set[int] | None = None,
                          broken: BrokenLog | None = None) -> OutputProcessor:
    eos = eos if eos is not None else set()
    return OutputProcessor(
        Sampler(VOCAB, eos, torch.Generator().manual_seed(0)),
        Postprocessor(FakeDetokenizer(), eos, max_model_len),
        NoGrammars(),
        broken if broken is not None else BrokenLog(),
    )


def make_scheduler(config: SchedulerConfig, kv: KVCacheManager, max_model_len: int,
                   adapters=None, **kwargs) -> Scheduler:
    return Scheduler(config, kv, max_model_len, adapters,
                     outputs=make_output_processor(max_model_len), **kwargs)


def next_output_token(sched: Scheduler, seq_id: int) -> int:
    """The default pick: 101, 102, ... for a sequence's 1st, 2nd, ... output token."""
    return 101 + sched.seqs[seq_id].num_output_tokens


def model_output(sched: Scheduler, plan: SchedulerOutput,
                 token: Callable[[Scheduler, int], int] = next_output_token) -> ModelOutput:
    """Logits for the plan's rows (in plan order) that pick ``token(sched, seq_id)``."""
    logits = torch.zeros(len(plan.scheduled), VOCAB)
    for i, row in enumerate(plan.scheduled):
        logits[i, token(sched, row.seq_id)] = PICK
    return ModelOutput(list(plan.scheduled), logits)


def step(sched: Scheduler, token: Callable[[Scheduler, int], int] = next_output_token,
         ) -> tuple[SchedulerOutput, StepOutcome]:
    """Plan a step and apply a model output to it, as the engine does."""
    plan = sched.schedule()
    outcome = sched.update_from_output(plan, model_output(sched, plan, token))
    return plan, outcome
