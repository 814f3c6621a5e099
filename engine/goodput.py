"""The goodput objective of the step budget: how many prompt tokens the next step takes beside
running decodes, chosen to maximise the requests that meet *both* their objectives — a first
token within the TTFT target, and a mean inter-token time (TPOT) within the ITL target.

The step budget (``step_budget.py``) first caps prompt tokens so the step stays within the ITL
target (the *floor*: what today's streams were promised). This module then asks whether more
prompt tokens pay, with the learnt step costs and one count:

* each waiting or part-way prompt (in the order the scheduler takes them) meets its TTFT if its
  last prompt token is computed by its deadline: this step with a cap of ``P`` tokens, else at
  the floor's pace in the steps after (each costing the floor's step);
* each running stream meets its TPOT if the extra time this step costs over the floor's step
  fits its *slack*: ``tpot · (tokens it may still reach - 1) - time since its first token -
  its remaining tokens at the floor's step``.

The count is a step function of ``P`` that only prompts raise (a stream's count only falls as
the step grows), so its maximum lies at the floor or at a point where one prompt needs one step
fewer: :func:`best_prompt_cap` evaluates exactly those points (ties: the smallest cap), which
tests check against a search of every ``P``. Streams about to miss keep the floor; prompts about
to miss while streams have slack get more of the step, up to the whole token budget (as vLLM
lets a prompt in whole).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

__all__ = ["MAX_PROMPTS", "KeyObjectives", "PromptDemand", "best_prompt_cap", "met_count", "stream_slack"]

MAX_PROMPTS = 32
"""Prompts the count looks at (the first in the scheduler's order): a deep queue's tail cannot
be helped by this step and would only cost the search."""
MAX_BREAKPOINTS = 256
"""Caps evaluated per step at most (beside the floor)."""


@dataclass(frozen=True)
class PromptDemand:
    """A prompt the next steps may compute."""

    tokens: int
    """Prompt tokens left to compute."""
    deadline: float
    """Clock time (the step budget's) by which its first token is due."""


def stream_slack(now: float, first_token_time: float, generated: int, remaining: int,
                 tpot_s: float, step_s: float) -> float:
    """Seconds a running stream may lose in this step and still meet ``tpot_s`` on average:
    ``generated`` tokens out since ``first_token_time``, at most ``remaining`` more at
    ``step_s`` each (the floor's step). Negative: it misses already."""
    total = generated + max(0, remaining)
    return tpot_s * max(1, total - 1) - (now - first_token_time) - max(0, remaining) * step_s


def met_count(cap: int, floor: int, cost: Callable[[int], float], prompts: Sequence[PromptDemand],
              slacks: Sequence[float], now: float) -> int:
    """Objectives met with a cap of ``cap`` prompt tokens this step (``floor`` after it):
    ``cost(p)`` is the predicted step with ``p`` prompt tokens."""
    step, base = cost(cap), cost(floor)
    delay = step - base
    met = sum(1 for s in slacks if s >= delay)
    done = 0
    for demand in prompts[:MAX_PROMPTS]:
        done += demand.tokens
        if done <= cap:
            first = now + step
        elif floor > 0:
            first = now + step + math.ceil((done - cap) / floor) * base
        else:
            first = math.inf
        met += first <= demand.deadline
    return met


def best_prompt_cap(floor: int, ceiling: int, cost: Callable[[int], float],
                    prompts: Sequence[PromptDemand], slacks: Sequence[float], now: float) -> int:
    """The cap in ``[floor, ceiling]`` that meets the most objectives (:func:`met_count`), the
    smallest such. Evaluates the floor and every cap at which one prompt needs a step fewer."""
    if ceiling <= floor or floor <= 0 or not prompts:
        return floor
    caps, done = {floor}, 0
    for demand in prompts[:MAX_PROMPTS]:
        done += demand.tokens
        # its first token moves a step earlier at done, done - floor, done - 2 floor, ...
        p = done - max(0, math.ceil((done - ceiling) / floor)) * floor
        while p > floor and len(caps) < MAX_BREAKPOINTS:
            caps.add(p)
            p -= floor
    best, best_met = floor, met_count(floor, floor, cost, prompts, slacks, now)
    for cap in sorted(caps):
        met = met_count(cap, floor, cost, prompts, slacks, now)
        if met > best_met:
            best, best_met = cap, met
    return best


class KeyObjectives:
    """Per fairness key (the platform's tenant), its own TTFT and ITL objectives in seconds
    (None: the engine's); set from any thread, read by the step budget on the engine thread."""

    def __init__(self) -> None:
        self._by_key: dict[object, tuple[float | None, float | None]] = {}

    def set(self, key: object, ttft_ms: float | None, itl_ms: float | None) -> None:
        """``key``'s objectives from its next step on; both None drops them."""
        if ttft_ms is None and itl_ms is None:
            self._by_key.pop(key, None)
        else:
            self._by_key[key] = (ttft_ms / 1000 if ttft_ms else None, itl_ms / 1000 if itl_ms else None)

    def get(self, key: object) -> tuple[float | None, float | None]:
        """``(ttft_s, itl_s)`` of ``key`` (each None: the engine's)."""
        return self._by_key.get(key, (None, None))
