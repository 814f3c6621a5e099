"""Admission policies: the order waiting sequences are offered a place in the batch, and
which running sequence is preempted when KV blocks run out.

:class:`FifoPolicy` is arrival order. :class:`VtcPolicy` is the Virtual Token Counter of
"Fairness in Serving Large Language Models" (Sheng et al., OSDI '24): every fairness key
(opaque to the engine; the platform passes the tenant) has a counter of the tokens served
to it, prefill tokens at cost 1 and decode tokens at cost 2 (the paper's weights), divided
by the request's ``weight``. Admission takes the key with the lowest counter first; a key
that becomes active after being idle is lifted to the lowest counter among the active keys,
so idling earns no credit; preemption takes the newest sequence of the key with the highest
counter. A key alone gets the whole engine (the order within a key is arrival order).
"""

from __future__ import annotations

from collections import Counter, defaultdict, deque
from typing import Protocol

from loramux.engine.sequence import Sequence

PREFILL_COST = 1.0
"""Counter charge per prompt token computed."""
DECODE_COST = 2.0
"""Counter charge per generated token."""


class FairnessPolicy(Protocol):
    """What the scheduler asks of a fairness policy (all calls on the engine thread)."""

    slack: float
    """How far behind a waiting key must be before :meth:`displace` preempts for it
    (weighted tokens); the scheduler sets it each step from the step budget."""

    def order(self, waiting: deque[Sequence]) -> list[Sequence]:
        """Waiting sequences, first to admit first; called once per step."""

    def victim(self, candidates: list[Sequence]) -> Sequence:
        """The running sequence to preempt, from ``candidates`` (oldest first)."""

    def displace(self, seq: Sequence, running: list[Sequence]) -> Sequence | None:
        """A running sequence to preempt so waiting ``seq`` can start now (no room for it
        otherwise), or None to let ``seq`` wait."""

    def on_add(self, seq: Sequence) -> None:
        """A sequence entered the scheduler (a new request or a fork)."""

    def on_finish(self, seq: Sequence) -> None:
        """A sequence left the scheduler (finished or aborted)."""

    def charge(self, seq: Sequence, num_tokens: int, is_prefill: bool) -> None:
        """``num_tokens`` of ``seq`` were scheduled in this step."""


class FifoPolicy:
    """Arrival order (preempted sequences return to the front); preempts the newest."""

    slack = 0.0  # never displaces, so the slack has no effect

    def order(self, waiting: deque[Sequence]) -> list[Sequence]:
        return list(waiting)

    def victim(self, candidates: list[Sequence]) -> Sequence:
        return candidates[-1]

    def displace(self, seq: Sequence, running: list[Sequence]) -> Sequence | None:
        return None

    def on_add(self, seq: Sequence) -> None:
        pass

    def on_finish(self, seq: Sequence) -> None:
        pass

    def charge(self, seq: Sequence, num_tokens: int, is_prefill: bool) -> None:
        pass


class VtcPolicy:
    """Virtual Token Counter fair share across ``Sequence.fairness_key`` values."""

    def __init__(self, slack: float = 0.0) -> None:
        self.slack = slack
        """A waiting key displaces a running one only when it is behind by more than this
        (weighted tokens; the scheduler passes one full decode step's charge), so keys do not
        thrash."""
        self.counters: dict[str | None, float] = {}
        """Weighted tokens served per key (only compared, never reset)."""
        self._active: Counter[str | None] = Counter()
        """Live (waiting or running) sequences per key."""

    def on_add(self, seq: Sequence) -> None:
        key = seq.fairness_key
        if self._active[key] == 0:
            active = [self.counters[k] for k, n in self._active.items() if n > 0]
            floor = min(active) if active else self.counters.get(key, 0.0)
            self.counters[key] = max(self.counters.get(key, 0.0), floor)
        self._active[key] += 1

    def on_finish(self, seq: Sequence) -> None:
        key = seq.fairness_key
        self._active[key] -= 1
        if self._active[key] <= 0:
            del self._active[key]

    def charge(self, seq: Sequence, num_tokens: int, is_prefill: bool) -> None:
        cost = PREFILL_COST if is_prefill else DECODE_COST
        key = seq.fairness_key
        self.counters[key] = self.counters.get(key, 0.0) + cost * num_tokens / seq.fairness_weight

    def order(self, waiting: deque[Sequence]) -> list[Sequence]:
        """Repeatedly the head of the key with the lowest counter, each pick charged its
        prompt on a scratch copy of the counters (so one step interleaves the keys)."""
        queues: dict[str | None, deque[Sequence]] = {}
        for seq in waiting:
            queues.setdefault(seq.fairness_key, deque()).append(seq)
        if len(queues) <= 1:
            return list(waiting)
        scratch = {k: self.counters.get(k, 0.0) for k in queues}
        out: list[Sequence] = []
        while queues:
            key = min(queues, key=scratch.__getitem__)
            seq = queues[key].popleft()
            out.append(seq)
            scratch[key] += PREFILL_COST * seq.num_tokens / seq.fairness_weight
            if not queues[key]:
                del queues[key]
        return out

    def victim(self, candidates: list[Sequence]) -> Sequence:
        top = max(self.counters.get(s.fairness_key, 0.0) for s in candidates)
        return [s for s in candidates if self.counters.get(s.fairness_key, 0.0) == top][-1]


    def displace(self, seq: Sequence, running: list[Sequence]) -> Sequence | None:
        """The newest running sequence of the key with the highest counter, when that key
        is ahead of ``seq``'s by more than ``slack``."""
        mine = self.counters.get(seq.fairness_key, 0.0)
        others = [s for s in running if s.fairness_key != seq.fairness_key]
        if not others:
            return None
        victim = self.victim(others)
        return victim if self.counters.get(victim.fairness_key, 0.0) - mine > self.slack else None


def make_policy(name: str, slack: float = 0.0) -> FairnessPolicy:
    """The policy named by ``SchedulerConfig.fairness_policy``."""
    return VtcPolicy(slack) if name == "vtc" else FifoPolicy()


def fair_rows(candidates: list[Sequence], max_rows: int, waiting_keys: set,
              by_key: bool = True) -> list[Sequence]:
    """``max_rows`` of ``candidates`` shared across fairness keys by weighted
    water-filling (small demands first; a key that needs less than its share leaves the
    rest to the others; a key with only a waiting prompt holds one share for it), each
    key's least recently run rows first (``by_key`` False: all rows as one key's).
    Returned in ``candidates`` order."""
    groups: dict = defaultdict(list)
    for seq in candidates:
        groups[seq.fairness_key if by_key else None].append(seq)
    if not by_key:
        waiting_keys = set()
    weight = {k: seqs[0].fairness_weight for k, seqs in groups.items()}
    need = {k: len(seqs) for k, seqs in groups.items()}
    for k in waiting_keys:
        if k not in need:
            weight[k], need[k] = 1.0, 1  # a prompt's share: kept out of the decode rows
    give = {}
    left = max_rows
    todo = sorted(need, key=lambda k: (need[k] / weight[k], str(k)))  # small demands first
    for i, k in enumerate(todo):
        rest = sum(weight[j] for j in todo[i:])
        give[k] = min(need[k], left, max(1, int(left * weight[k] / rest)))
        left -= give[k]
    for k in groups:  # a key with decodes never stops (a waiting prompt's share cannot starve it)
        give[k] = max(give[k], 1)
    chosen: set[int] = set()
    for k, seqs in groups.items():
        rotation = sorted(seqs, key=lambda s: s.budget_ran)  # least recently run first
        chosen.update(id(s) for s in rotation[: give[k]])
    return [s for s in candidates if id(s) in chosen]
