"""A step-time budget (Sarathi-Serve's idea, adapted to tenants sharing one engine): the
inter-token latency target as a scheduled quantity.

A decode row gets one token per step it runs in, so a step's wall time *is* the gap its
streaming client sees between two tokens. On the CPU a step's cost grows with every row and
prompt token in it: a 600-token prompt chunk beside running decodes froze their streams for
seconds, and a flooder's 256 decode sequences made every step ~1 s. So each step is filled up
to a time, not to a fixed token/sequence count:

* :class:`StepCostModel` fits ``seconds ≈ c0 + c_decode · decode rows + c_prefill ·
  prompt tokens + c_adapter · adapters + c_draft · drafted tokens`` online from the measured
  cycle of every step (planning to the next step: outputs delivered included): non-negative
  least squares over recent steps (forgetting :data:`FORGET` a step), with a long memory's fit
  (:data:`FORGET_LONG`) as its prior, so what a steady workload's recent steps cannot tell
  apart (c0 against c_decode while every step has the same rows) keeps its earlier value.
* :class:`StepBudget` turns the **ITL target** (``SchedulerConfig.target_itl_ms``; unset,
  :data:`DEFAULT_MULTIPLE` × the predicted one-row decode step, so it follows the machine;
  for a key alone :data:`ALONE_MULTIPLE` × that, and at least × the step of its running decodes)
  into limits for the next step:

  - While the cost model is cold (its first :data:`WARM_STEPS` steps) or has no price for
    prompt tokens, a step beside decode rows takes at most :data:`COLD_CHUNK_TOKENS` of them.
  - While any decode row runs, the step's prompt tokens are capped so the predicted step
    stays within the target: prompt chunks fill what the decodes leave, never below
    :data:`MIN_CHUNK_TOKENS` nor below :data:`CHUNK_SHARE` of the decodes' own cost, so the
    prompts ahead of a waiting one shrink by at least that every step (no starvation).
    A step with no decode row gives its prompts the whole token budget (no one's ITL is at
    stake).
  - While more than one fairness key has work (or had, within :data:`RECENT_S`) the step
    aims at :data:`CONTENTION_SHARE` of the target of one row with its adapter (however many
    adapters the step's rows use: a tenant spraying adapters cannot stretch it): decode rows
    are capped to what fits, each row costed with its share of the step's adapters, and
    shared fairly across keys (water-filling; within a key the least recently scheduled
    rows first, so a flooder's surplus rotates and a small key's rows run every step), with
    room kept for waiting keys' prompts.
  - One key alone with only decodes keeps the fewest rows that still give
    :data:`ALONE_EFFICIENCY` of the throughput of running them all (its throughput stays
    within a few percent of the uncapped engine's, a newcomer never waits behind a step of
    every row); alone with prompts to compute, every row runs and the prompts take what the
    target leaves.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np
from scipy.optimize import nnls

from loramux.engine.fairness import fair_rows
from loramux.engine.goodput import (
    LONGEST_STEP_MULTIPLE,
    MAX_PROMPTS,
    KeyObjectives,
    PromptDemand,
    PromptInflow,
    StreamDemand,
    best_prompt_cap,
    first_prompt_whole,
    keeping_pace,
    stream_slack,
)
from loramux.engine.sequence import Sequence

DEFAULT_MULTIPLE = 3.0
"""Derived ITL target = this × the predicted cost of a one-row decode step (while fairness keys
compete; the derived TTFT objective is this × a prompt's own prefill alone)."""
ALONE_MULTIPLE = 5.0
"""A key alone: its derived ITL target is this × the one-row step, and at least this × the step of
its running decodes. The stretch falls on its own streams only, and larger steps pay each step's
fixed cost less often: near saturation (the peer benchmark's 1.5 req/s, bf16, AVX512_BF16 EPYC) 5
against 3 served more tokens with both first tokens and inter-token gaps sooner (docs/peer-benchmark.md)."""
CONTENTION_SHARE = 0.5
"""While fairness keys compete a step aims at this share of the ITL target: a small key's
rows, which run every step, stay well within it beside a flooder whose surplus rotates."""
MIN_CHUNK_TOKENS = 16
"""Fewest prompt tokens a step beside decodes still computes (prompts always progress)."""
COLD_CHUNK_TOKENS = 256
"""Most prompt tokens beside decode rows while the cost model cannot price them yet (cold,
or no prompt step observed in its memory): without it a new engine's first steps took every
waiting prompt whole beside running decodes (seconds-long freezes while traffic ramps up)."""
CHUNK_SHARE = 0.5
"""A prompt chunk beside decodes may cost at least this fraction of the decodes' own cost."""
ALONE_EFFICIENCY = 0.95
"""Outside contention a step keeps the fewest decode rows whose predicted throughput
(rows per second) is still this share of running them all: a newcomer then waits for a
shorter step, and the tenant alone loses at most the rest."""
RECENT_S = 2.0
"""A key that had work this many seconds ago still counts as competing (interactive
tenants send their next request right after the last one ends)."""
WARM_STEPS = 8
"""Steps observed before the cost model is trusted (until then nothing is capped)."""
SKIP_FIRST = 2
"""First steps not observed at all (one-off costs: lazy initialisation, first allocations)."""
FORGET = 0.97
"""Weight of past observations per new step (recent steps count most)."""
FORGET_LONG = 0.999
"""The long memory's weight per step: the prior that keeps what recent steps cannot tell."""
PRIOR_STEPS = 16.0
"""How many recent steps' worth the long memory's fit weighs against the recent fit."""
_RIDGE = 1e-6


@dataclass(frozen=True)
class StepShape:
    """What a step carries, as the cost model sees it."""

    decode_rows: int
    prefill_tokens: int
    adapters: int
    draft_tokens: int = 0
    """Drafted tokens of verify rows (speculative decoding): their own feature, a small
    verify row's token costs more than a long prompt chunk's."""

    def features(self) -> np.ndarray:
        return np.array([1.0, self.decode_rows, self.prefill_tokens, self.adapters, self.draft_tokens])


class StepCostModel:
    """Online least squares of a step's wall time over :class:`StepShape` features."""

    def __init__(self, forget: float = FORGET) -> None:
        self.forget = forget
        self._xtx = np.zeros((5, 5))
        self._xty = np.zeros(5)
        self._long_xtx = np.zeros((5, 5))
        self._long_xty = np.zeros(5)
        self._long_weight = 0.0
        self.num_observed = 0
        self._skipped = 0
        self._all = np.zeros(5)
        self.coef = self._all[:4]
        """[c0, c_decode, c_prefill, c_adapter] in seconds (non-negative)."""
        self.c_draft = 0.0
        """Seconds per drafted token (0 until verify rows were observed)."""

    @property
    def warm(self) -> bool:
        return self.num_observed >= WARM_STEPS

    def observe(self, shape: StepShape, seconds: float) -> None:
        """Add one measured step and refit (two 5×5 NNLS solves: tens of microseconds)."""
        if not math.isfinite(seconds) or seconds < 0:
            return
        if self._skipped < SKIP_FIRST:
            self._skipped += 1
            return
        x = shape.features()
        self._xtx = self.forget * self._xtx + np.outer(x, x)
        self._xty = self.forget * self._xty + x * seconds
        self._long_xtx = FORGET_LONG * self._long_xtx + np.outer(x, x)
        self._long_xty = FORGET_LONG * self._long_xty + x * seconds
        self._long_weight = FORGET_LONG * self._long_weight + 1.0
        self.num_observed += 1
        # the recent fit with the long memory's as its prior: a steady workload (a flooder's
        # same-sized steps) leaves some coefficients unidentified by recent steps alone, and
        # the fit then moved the whole cost into c0 (a one-row step predicted 4x too long,
        # and the derived ITL target with it); the prior keeps those from the longer past
        prior = PRIOR_STEPS / self._long_weight * self._long_xtx
        long_fit = _nonnegative_fit(self._long_xtx, self._long_xty)
        self._all = _nonnegative_fit(self._xtx + prior, self._xty + prior @ long_fit)
        self.coef = self._all[:4]
        self.c_draft = float(self._all[4])

    def predict(self, shape: StepShape) -> float:
        return float(shape.features() @ self._all)


def _nonnegative_fit(xtx: np.ndarray, xty: np.ndarray) -> np.ndarray:
    """The non-negative least-squares coefficients from the (forgetting) normal equations:
    ``min ||X c - y||`` subject to ``c >= 0`` via the Cholesky factor ``xtx = L Lᵀ`` (the
    objective is ``||Lᵀ c - L⁻¹ Xᵀy||`` up to a constant) and SciPy's NNLS. Clipping the
    unconstrained solution instead broke down when features move together (decode rows and
    drafted tokens under sustained drafting): a negative coefficient clipped to zero left
    its partner inflated, and the steps were predicted 2-3x longer than they ran."""
    ridge = _RIDGE * np.diag(np.diag(xtx) + 1e-12)  # scale-free; solves unseen features
    lower = np.linalg.cholesky(xtx + ridge)
    coef, _ = nnls(lower.T, np.linalg.solve(lower, xty))
    return coef


DEFAULT_COST_RATIO = 0.1
"""Cost ratio per decode row of the step before the cost model is warm (or without a step
budget): one more token cost ~10% of a decode token's share of a step on the CPU."""


def cost_ratio(coef, num_rows: int, num_adapters: int, c_draft: float = 0.0) -> float:
    """What one more token costs a step of ``num_rows`` decode rows over what each of its
    decode tokens costs: ``c_token * rows / step``, from the fitted coefficients ``coef`` =
    (c0, c_decode, c_prompt_token, c_adapter), or None; ``c_token`` is the fitted cost of a
    drafted token ``c_draft`` once verify rows were seen, else a prompt token's. Speculative
    decoding drafts a token only while its chance of acceptance exceeds this."""
    rows = max(1, num_rows)
    if coef is not None:
        c0, c_dec, c_tok, c_ad = (float(c) for c in coef)
        c_tok = c_draft if c_draft > 0 else c_tok
        step = c0 + c_dec * rows + c_ad * num_adapters
        if step > 0 and c_tok > 0:
            return min(0.95, c_tok * rows / step)
    return min(0.95, DEFAULT_COST_RATIO * rows)


@dataclass(frozen=True)
class StepLimits:
    """The next step's caps, decided once before it is planned (carried on its plan)."""

    decode: frozenset[int] | None = None
    """Sequence ids of the running decodes that run (None = all of them)."""
    prefill_tokens: int | None = None
    """Most prompt tokens beside them (None = only the token budget applies)."""
    draft_weight: float = 1.0
    """Prompt tokens of ``prefill_tokens`` one drafted token counts as (their fitted costs'
    ratio): drafts and prompt chunks share the cap."""
    draft_cost_ratio: float = DEFAULT_COST_RATIO
    """What one more drafted token costs the step (:func:`cost_ratio`)."""

    def runs(self, seq: Sequence) -> bool:
        """True when running decode ``seq`` takes part in the step."""
        return self.decode is None or seq.seq_id in self.decode

    @staticmethod
    def uncapped(num_decodes: int, adapters: int) -> StepLimits:
        """The limits of a scheduler without a step budget (token and sequence limits only)."""
        return StepLimits(draft_cost_ratio=cost_ratio(None, num_decodes, adapters))


class StepBudget:
    """Fills a step up to the target step time; the scheduler asks it once per step."""

    def __init__(self, target_itl_ms: float | None = None, model: StepCostModel | None = None, *,
                 target_ttft_ms: float | None = None, token_budget: int | None = None) -> None:
        """``target_ttft_ms``: the first-token objective of the goodput count (None: derived per
        prompt, :data:`DEFAULT_MULTIPLE` × its own prefill alone); ``token_budget``: the most
        tokens a step takes (None: the goodput objective never raises the prompt cap)."""
        self.target_s = target_itl_ms / 1000.0 if target_itl_ms else None
        self.ttft_s = target_ttft_ms / 1000.0 if target_ttft_ms else None
        self.token_budget = token_budget
        self.objectives = KeyObjectives()
        """Per fairness key, its own objectives in the goodput count (tenants' quotas)."""
        self.model = model or StepCostModel()
        self.steps = 0
        self.last_target: float | None = None
        """Seconds: the target the last step with decode rows was held to."""
        self._last_seen: dict = {}  # fairness key -> clock time it last had work
        self._inflow = PromptInflow()
        self.mean_step: float | None = None
        self.clock = time.monotonic
        """Seconds (monotonic); tests put a fake clock here."""

    def target(self, adapters: int = 0, multiple: float = DEFAULT_MULTIPLE) -> float:
        """The ITL target in seconds: the configured one, or the derived one, ``multiple`` × the
        one-row step (0.0 while the cost model is cold and none is configured)."""
        if self.target_s is not None:
            return self.target_s
        return multiple * self.model.predict(StepShape(1, 0, adapters))

    def itl_target(self) -> float | None:
        """The ITL target the last step with decode rows promised them (else the one-row
        target; seconds; None until it is known)."""
        if self.target_s is None and not self.model.warm:
            return None
        return self.last_target if self.last_target is not None else self.target(1)

    def observe(self, shape: StepShape, seconds: float) -> None:
        self.model.observe(shape, seconds)
        if math.isfinite(seconds) and seconds >= 0:  # the recent mean step (~32 steps)
            self.mean_step = seconds if self.mean_step is None else self.mean_step + (seconds - self.mean_step) / 32

    def plan(self, candidates: list[Sequence], keys_with_prompts: set, adapters: int,
             fair: bool = True, prompts: list[Sequence] = ()) -> StepLimits:
        """The limits of the next step (called once per step, before it is planned): which of
        the running decode ``candidates`` (oldest first) run, how many prompt tokens may join
        them, and what a drafted token costs. ``keys_with_prompts``: fairness keys with a
        waiting or part-way prompt (their share of the rows is kept for it); ``adapters``:
        distinct adapters of the running sequences. ``fair`` False (FCFS admission): every
        row counts as one key's. ``prompts``: the sequences with prompt tokens to compute, in the
        order the scheduler takes them (part-way first): the goodput objective may give them more
        of the step (``goodput.py``)."""
        decode, prefill = self._decode_and_prefill(candidates, keys_with_prompts, adapters, fair, prompts)
        m = self.model
        coef, c_draft = (m.coef, m.c_draft) if m.warm else (None, 0.0)
        c_pre = float(m.coef[2]) if m.warm else 0.0
        return StepLimits(
            None if len(decode) == len(candidates) else frozenset(s.seq_id for s in decode),
            prefill,
            c_draft / c_pre if c_draft > 0 and c_pre > 0 else 1.0,
            cost_ratio(coef, len(candidates), adapters, c_draft),
        )

    def _decode_and_prefill(self, candidates: list[Sequence], keys_with_prompts: set,
                            adapters: int, fair: bool, prompts: list[Sequence] = (),
                            ) -> tuple[list[Sequence], int | None]:
        """The decode rows that run and the prompt-token cap (None = none) of :meth:`plan`."""
        self.steps += 1
        now = self.clock()
        keys = {s.fairness_key for s in candidates} | keys_with_prompts if fair else {None}
        for key in keys:
            self._last_seen[key] = now
        for key in [k for k, t in self._last_seen.items() if now - t > RECENT_S]:
            del self._last_seen[key]
        if not self.model.warm:
            return candidates, COLD_CHUNK_TOKENS if candidates else None
        m = self.model
        c0, c_dec, c_pre, c_ad = m.coef
        decode = candidates
        n = len(candidates)
        alone = len(self._last_seen) <= 1  # no other key had work within RECENT_S
        # the target of one row with its adapter: a tenant spraying adapters must not stretch
        # its neighbours' ITL
        target = (self.target(min(adapters, 1), ALONE_MULTIPLE) if alone
                  else CONTENTION_SHARE * self.target(min(adapters, 1)))
        # a row's cost, its share of the adapters' included: the fit may put a step's cost on
        # either when rows and adapters grow together (one tenant spraying its adapters)
        c_row = c_dec + (c_ad * adapters / n if n else 0.0)
        if n > 1 and c_row > 0:
            fixed = c0 + c_ad * adapters
            reserve = c_pre * MIN_CHUNK_TOKENS if keys_with_prompts else 0.0
            # every key with decodes keeps at least one row: nobody stops
            max_rows = max(len({s.fairness_key for s in candidates}),
                           int((target - c0 - reserve) / c_row))
            if alone and keys_with_prompts:
                # alone with prompts to compute: every row runs and the prompts take what the
                # target leaves (capping its own decodes cost it ~10% throughput, ~2x TTFT)
                max_rows = n
            elif alone:  # decodes only: the rows its throughput needs
                e = ALONE_EFFICIENCY
                max_rows = max(max_rows, math.ceil(e * n * fixed / (fixed + (1 - e) * n * max(c_dec, 1e-9))))
            if max_rows < n:
                decode = fair_rows(candidates, max_rows, keys_with_prompts, by_key=fair)
        for seq in decode:
            seq.budget_ran = self.steps
        decode_cost = c_dec * len(decode) + c_ad * (adapters if alone else
                                                    len({s.lora_key for s in decode if s.lora_key}) + 1)
        if alone and self.target_s is None:
            # derived, alone: ALONE_MULTIPLE x this step's decodes (at least x one row's), so
            # a prompt chunk stretches the tenant's own inter-token gaps by that much at most
            target = max(target, ALONE_MULTIPLE * (c0 + decode_cost))
        if decode:
            self.last_target = target
        if not decode:  # a prompt alone: nobody's inter-token latency at stake
            return decode, None
        if c_pre <= 0:  # no prompt cost learnt yet: a bounded chunk, which teaches it
            return decode, COLD_CHUNK_TOKENS
        left = max(target - c0 - decode_cost, CHUNK_SHARE * decode_cost)
        floor = max(MIN_CHUNK_TOKENS, int(left / c_pre))
        return decode, self._goodput_cap(floor, decode, prompts, c0 + decode_cost, target, now, alone)

    def _goodput_cap(self, floor: int, decode: list[Sequence], prompts: list[Sequence],
                     fixed: float, tpot_s: float, now: float, alone: bool) -> int:
        """The prompt-token cap that meets the most TTFT and TPOT objectives (``goodput.py``):
        ``floor`` (the ITL target's), more where prompts about to miss their first token can
        have it while the streams keep their TPOT, less (down to :data:`MIN_CHUNK_TOKENS`) where
        streams about to miss theirs need it. ``fixed``: the step's cost without prompts;
        ``alone``: one fairness key has work (only then may the pace floor pass the ITL target:
        under contention the target holds a flooder's queue back from its neighbours' streams)."""
        if self.token_budget is None:
            return floor
        c0, c_pre = float(self.model.coef[0]), float(self.model.coef[2])
        own, inflow = self.objectives.get, self._inflow.observe(now, prompts)
        ceiling = self.token_budget - len(decode)
        # never below the pace prompts arrive at (a queue that only grows misses every TTFT), in
        # steps growing toward it together: none past a few times the recent mean step
        pace = keeping_pace(inflow, fixed, c_pre) if alone else 0
        if self.mean_step and c_pre > 0:
            pace = min(pace, int((LONGEST_STEP_MULTIPLE * self.mean_step - fixed) / c_pre))
        floor = max(floor, min(ceiling, pace))

        def cost(p: int) -> float:
            return fixed + c_pre * p

        def arriving(left: int) -> int:
            """Prompt tokens expected while a stream runs ``left`` more steps; under contention
            the queue is taken as never draining (a flooder may keep it full), so a stream is
            charged for all prompt work taken sooner"""
            return int(inflow * left * cost(floor)) if alone else 1 << 30

        streams = []
        for s in decode:
            if s.first_token_time is not None:
                left = max(0, (s.params.max_tokens or 0) - s.num_output_tokens)
                slack = stream_slack(now, s.first_token_time, s.num_output_tokens, left,
                                     own(s.fairness_key)[1] or tpot_s, fixed)
                streams.append(StreamDemand(slack, left, arriving(left)))
        demands = [PromptDemand(s.num_tokens - s.num_computed_tokens, s.arrival_time + (
            own(s.fairness_key)[0] or self.ttft_s or DEFAULT_MULTIPLE * (c0 + c_pre * s.num_tokens)))
            for s in prompts[:MAX_PROMPTS]]
        # the streams share their steps with every queued prompt, not only the first ones
        queued = sum(s.num_tokens - s.num_computed_tokens for s in prompts)
        cap = best_prompt_cap(floor, ceiling, cost, demands, streams, now, lowest=MIN_CHUNK_TOKENS, queued=queued)
        # a key alone under a derived ITL target: its first prompt whole where no objective pays
        # for it (an ITL target the operator or the tenant's quota set holds every step; under
        # contention the target's chunk holds a flooder's prompts back from its neighbours')
        derived = self.target_s is None and not any(own(s.fairness_key)[1] for s in decode)
        if alone and derived:
            return first_prompt_whole(cap, floor, ceiling, cost, demands, streams, now, queued)
        return cap
