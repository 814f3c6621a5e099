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


def _last_within(cost: Callable[[int], float], lo: int, hi: int, limit: float) -> int | None:
    """The largest cap in ``[lo, hi]`` whose step costs at most ``limit`` (None: not even ``lo``);
    the cost grows with the cap."""
    if lo > hi or cost(lo) > limit:
        return None
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if cost(mid) <= limit else (lo, mid - 1)
    return lo


def _endpoints(floor: int, lo: int, hi: int, cost: Callable[[int], float],
               prompts: Sequence[PromptDemand], slacks: Sequence[float], now: float) -> set[int]:
    """Every cap where one objective's met set begins or ends: each is a union of intervals of
    caps (a prompt's, one per number of floor steps it still needs; a stream's, one), so the
    count's best caps nearest the floor are among these, the bounds and the floor."""
    base = cost(floor)
    caps = {lo, floor, hi}
    for slack in slacks:
        caps.add(_last_within(cost, lo, hi, base + slack) or lo)
    done = 0
    for demand in prompts[:MAX_PROMPTS]:
        done += demand.tokens
        k = 0  # floor steps after this one; the cap range where it needs exactly k
        while len(caps) < MAX_BREAKPOINTS:
            start, stop = (done, hi) if k == 0 else (done - k * floor, done - (k - 1) * floor - 1)
            start, stop = max(start, lo), min(stop, hi)
            if stop < lo:
                break
            last = _last_within(cost, start, stop, demand.deadline - now - k * base)
            if last is not None:
                caps.update((start, last))
            k += 1
    return {c for c in caps if lo <= c <= hi}


def best_prompt_cap(floor: int, ceiling: int, cost: Callable[[int], float],
                    prompts: Sequence[PromptDemand], slacks: Sequence[float], now: float,
                    lowest: int | None = None) -> int:
    """The cap in ``[lowest, ceiling]`` (``lowest`` default: ``floor``) that meets the most
    objectives (:func:`met_count`), the nearest the floor among equals: above it when prompts
    about to miss gain by it, below it when streams about to miss do."""
    lo = floor if lowest is None else min(lowest, floor)
    hi = max(ceiling, floor)
    if floor <= 0 or (not prompts and not slacks) or hi <= lo:
        return floor

    def rank(cap: int) -> tuple[int, int]:
        return met_count(cap, floor, cost, prompts, slacks, now), -abs(cap - floor)

    return max(sorted(_endpoints(floor, lo, hi, cost, prompts, slacks, now)), key=rank)


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
