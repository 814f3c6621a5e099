"""The goodput objective of the step budget: how many prompt tokens the next step takes beside
running decodes, chosen to maximise the requests that meet *both* their objectives — a first
token within the TTFT target, and a mean inter-token time (TPOT) within the ITL target.

The step budget (``step_budget.py``) first caps prompt tokens so the step stays within the ITL
target (the *floor*: what today's streams were promised). This module then asks whether more
prompt tokens pay, with the learnt step costs and one count:

* each waiting or part-way prompt (in the order the scheduler takes them) meets its TTFT if its
  last prompt token is computed by its deadline: this step with a cap of ``P`` tokens, else at
  the floor's pace in the steps after (each costing the floor's step);
* each running stream meets its TPOT if the prompt work computed in the steps it still runs in
  fits its *slack*: ``tpot · (tokens it may still reach - 1) - time since its first token -
  its remaining tokens at the step's cost without prompts``. Those steps compute ``P`` prompt
  tokens now and the floor's after, but never more than the queue holds plus what arrives
  meanwhile (:class:`PromptInflow`): prompt work the stream would share its steps with anyway
  costs it nothing more when it is computed sooner (its mean inter-token time is the same), so a
  queue that drains within a stream's life may be taken now — the first tokens come sooner and
  nobody's TPOT objective pays for it. (While fairness keys compete the step budget takes the
  queue as never draining: a flooder may keep it full.)

The floor never falls below the prompt tokens a step must compute to keep pace with the inflow
(:func:`keeping_pace`): the count cannot help a prompt already past its deadline, and a floor
that lets the queue grow makes every later prompt miss too.

The count is a step function of ``P`` that only prompts raise (a stream's count only falls as
the step grows), so its maximum lies at the floor or at a point where one prompt needs one step
fewer: :func:`best_prompt_cap` evaluates exactly those points (ties: the cap nearest the floor),
which tests check against a search of every ``P``. Streams about to miss keep the floor; prompts
about to miss while streams have slack get more of the step, up to the whole token budget (as
vLLM lets a prompt in whole). :func:`first_prompt_whole` then lets a key alone under a derived
ITL target take its first prompt whole where that costs no stream and no objective, with every
later step doing the same: first tokens a prompt a step instead of the floor's chunks (each
chunk's step pays the decodes' cost again before the first token).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

__all__ = ["LONGEST_STEP_MULTIPLE", "MAX_PROMPTS", "KeyObjectives", "PromptDemand", "PromptInflow",
           "StreamDemand", "best_prompt_cap", "first_prompt_whole", "keeping_pace", "met_count",
           "stream_slack"]

MAX_PROMPTS = 32
"""Prompts the count looks at (the first in the scheduler's order): a deep queue's tail cannot
be helped by this step and would only cost the search."""
INFLOW_WINDOW_S = 10.0
"""Seconds of arrivals the prompt inflow is measured over."""
LONGEST_STEP_MULTIPLE = 2.5
"""The longest step the pace floor asks for, over the recent mean step: its steps grow toward
the pace together, a few steps at a time, instead of one step taking the whole queue (a
stream's gaps stay within a few times its mean). The count may still give a prompt about to
miss the whole step where the streams' objectives allow it."""
MAX_BREAKPOINTS = 256
"""Caps evaluated per step at most (beside the floor)."""


@dataclass(frozen=True)
class PromptDemand:
    """A prompt the next steps may compute."""

    tokens: int
    """Prompt tokens left to compute."""
    deadline: float
    """Clock time (the step budget's) by which its first token is due."""


@dataclass(frozen=True)
class StreamDemand:
    """A running stream (a decode row) with a TPOT objective."""

    slack: float
    """Seconds of prompt work its remaining steps may carry and still meet its objective
    (:func:`stream_slack`)."""
    remaining: int
    """Tokens it may still generate (the steps it still runs in)."""
    arriving: int = 0
    """Prompt tokens expected to arrive while it runs (they join the queue it shares)."""


def stream_slack(now: float, first_token_time: float, generated: int, remaining: int,
                 tpot_s: float, step_s: float) -> float:
    """Seconds of prompt work a running stream's remaining steps may carry and still meet
    ``tpot_s`` on average: ``generated`` tokens out since ``first_token_time``, at most
    ``remaining`` more at ``step_s`` each without prompt work. Negative: it misses already."""
    total = generated + max(0, remaining)
    return tpot_s * max(1, total - 1) - (now - first_token_time) - max(0, remaining) * step_s


def _absorbed(cap: int, floor: int, queued: int, stream: StreamDemand) -> int:
    """Prompt tokens computed in the steps ``stream`` still runs in: ``cap`` now, ``floor`` in
    each after, at most the ``queued`` ones and those arriving meanwhile."""
    return min(queued + stream.arriving, cap + floor * max(0, stream.remaining - 1))


def _streams_met(cap: int, floor: int, cost: Callable[[int], float], streams: Sequence[StreamDemand],
                 queued: int) -> int:
    """Streams meeting their TPOT with ``cap`` prompt tokens this step and ``floor`` after."""
    bare = cost(0)
    return sum(1 for s in streams if cost(_absorbed(cap, floor, queued, s)) - bare <= s.slack)


def met_count(cap: int, floor: int, cost: Callable[[int], float], prompts: Sequence[PromptDemand],
              streams: Sequence[StreamDemand], now: float, queued: int | None = None) -> int:
    """Objectives met with a cap of ``cap`` prompt tokens this step (``floor`` after it):
    ``cost(p)`` is the predicted step with ``p`` prompt tokens (a cap above the queued prompt
    tokens costs what they cost). ``queued``: every queued prompt token (default: ``prompts``'),
    when ``prompts`` holds only the first of a deeper queue."""
    queued = sum(p.tokens for p in prompts) if queued is None else queued
    step, base = cost(min(cap, queued)), cost(min(floor, queued))
    met = _streams_met(cap, floor, cost, streams, queued)
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
               prompts: Sequence[PromptDemand], streams: Sequence[StreamDemand], now: float,
               queued: int) -> set[int]:
    """Every cap where one objective's met set begins or ends: each is a union of intervals of
    caps (a prompt's, one per number of floor steps it still needs; a stream's, one), so the
    count's best caps nearest the floor are among these, the bounds and the floor."""
    base, bare = cost(min(floor, queued)), cost(0)
    caps = {lo, floor, hi}
    for stream in streams:
        # met while the prompt tokens it absorbs stay within the most its slack pays for
        most = _last_within(cost, 0, queued + stream.arriving, bare + stream.slack)
        if most is not None:
            caps.add(min(hi, max(lo, most - floor * max(0, stream.remaining - 1))))
    done = 0
    for demand in prompts[:MAX_PROMPTS]:
        done += demand.tokens
        k = 0  # floor steps after this one; the cap range where it needs exactly k
        while len(caps) < MAX_BREAKPOINTS:
            start, stop = (done, hi) if k == 0 else (done - k * floor, done - (k - 1) * floor - 1)
            start, stop = max(start, lo), min(stop, hi)
            if stop < lo:
                break
            last = _last_within(lambda c: cost(min(c, queued)), start, stop, demand.deadline - now - k * base)
            if last is not None:
                caps.update((start, last))
            k += 1
    return {c for c in caps if lo <= c <= hi}


def best_prompt_cap(floor: int, ceiling: int, cost: Callable[[int], float],
                    prompts: Sequence[PromptDemand], streams: Sequence[StreamDemand], now: float,
                    lowest: int | None = None, queued: int | None = None) -> int:
    """The cap in ``[lowest, ceiling]`` (``lowest`` default: ``floor``) that meets the most
    objectives (:func:`met_count`, ``queued`` as there), the nearest the floor among equals:
    above it when prompts about to miss gain by it, below it when streams about to miss do."""
    lo = floor if lowest is None else min(lowest, floor)
    hi = max(ceiling, floor)
    if floor <= 0 or (not prompts and not streams) or hi <= lo:
        return floor
    queued = sum(p.tokens for p in prompts) if queued is None else queued

    def rank(cap: int) -> tuple[int, int]:
        return met_count(cap, floor, cost, prompts, streams, now, queued), -abs(cap - floor)

    return max(sorted(_endpoints(floor, lo, hi, cost, prompts, streams, now, queued)), key=rank)


def first_prompt_whole(cap: int, floor: int, ceiling: int, cost: Callable[[int], float],
                       prompts: Sequence[PromptDemand], streams: Sequence[StreamDemand], now: float,
                       queued: int | None = None) -> int:
    """``cap`` (:func:`best_prompt_cap`'s), or the first prompt whole (at most ``ceiling``) where
    that costs no objective, with every later step taking as much (a step's larger cap repeats
    every step): first tokens a prompt a step, as vLLM lets a prompt in whole, while every stream
    that meets its TPOT at ``cap`` and the floor's pace still meets it at that pace (a queue that
    drains within its life costs it nothing more) and no fewer objectives are met in all."""
    whole = min(ceiling, prompts[0].tokens) if prompts else cap
    if whole <= cap:
        return cap
    queued = sum(p.tokens for p in prompts) if queued is None else queued
    streams_whole, streams_cap = (_streams_met(whole, whole, cost, streams, queued),
                                  _streams_met(cap, floor, cost, streams, queued))
    prompts_whole, prompts_cap = (met_count(whole, whole, cost, prompts, (), now, queued),
                                  met_count(cap, floor, cost, prompts, (), now, queued))
    if streams_whole >= streams_cap and streams_whole + prompts_whole >= streams_cap + prompts_cap:
        return whole
    return cap


def keeping_pace(inflow: float, fixed: float, c_token: float) -> int:
    """The fewest prompt tokens a step must compute for the queue to keep pace with ``inflow``
    prompt tokens a second, steps costing ``fixed + c_token · tokens`` seconds (a very large
    number when no step size can)."""
    if inflow <= 0:
        return 0
    if inflow * c_token >= 1:
        return 1 << 30
    return math.ceil(inflow * fixed / (1 - inflow * c_token))


class PromptInflow:
    """The rate prompt tokens join the queue (tokens per second over the last
    :data:`INFLOW_WINDOW_S`): a prompt is new when it was not among the last step's prompts
    (a preempted sequence's recompute counts again: it is work again)."""

    def __init__(self) -> None:
        self._ids: set[int] = set()
        self._arrivals: deque[tuple[float, int]] = deque()
        self._since: float | None = None

    def observe(self, now: float, prompts: Sequence) -> float:
        """Record the prompts (sequences) of this step; the inflow in tokens per second."""
        ids = {s.seq_id for s in prompts}
        new = sum(s.num_tokens - s.num_computed_tokens for s in prompts if s.seq_id not in self._ids)
        self._ids = ids
        if self._since is None:
            self._since = now
        if new:
            self._arrivals.append((now, new))
        while self._arrivals and self._arrivals[0][0] < now - INFLOW_WINDOW_S:
            self._arrivals.popleft()
        span = min(INFLOW_WINDOW_S, now - self._since)
        return sum(n for _, n in self._arrivals) / span if span > 0 else 0.0


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
