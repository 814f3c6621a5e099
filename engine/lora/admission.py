"""Adapter admission under slot pressure: which adapters get the step's free slots.

The scheduler asks :meth:`SlotAdmission.plan` once per step, before it admits waiting
sequences, and then :meth:`SlotAdmission.allows` per waiting sequence. The policy:

* **Busy adapters keep their slots.** An adapter with running sequences is never evicted;
  one that is resident with queued (waiting) sequences is not evicted either, unless
  another adapter is *starving* (below). So a slot never flips back and forth between two
  adapters that both have work (no thrash).
* **Free slots go to queued work, then age.** The adapters of waiting sequences that are
  not running are ranked: starving ones first (oldest first), then resident ones (no load
  needed), then by queued work (waiting sequences: each is a row of the batch), ties to the
  older. The step's ``max_loras - busy`` adapter places go down that list; an adapter that
  is still loading does not take a place (the batch stays full with ready ones), it keeps
  its reserved slot and starts once loaded.
* **No starvation.** An adapter's age is the most steps one of its waiting sequences was
  skipped for want of a slot (``Sequence.skipped_steps``). At ``bound`` steps it is
  starving: when no slot is free for it, the busy adapter with the least queued work (then
  the fewest running sequences) is *closed*: it admits no new sequence, so it drains; if it
  still runs ``bound`` steps later its running sequences are preempted (recompute; their
  full KV blocks stay in the prefix cache). The starving adapter then takes the slot. So a
  sequence whose adapter is loaded (in the CPU tier) starts at most ``2 * bound + 2`` steps
  after it was first skipped for its adapter, whatever the stream of requests for others.
* **Fair share of the slots.** With the fair-share policy the scheduler hands the waiting
  sequences in its fair order (``fair_order``): a tenant (fairness key) that got little recent
  service ranks its adapters before those of a tenant that got much, so a newcomer's one
  adapter gets the next free slot before a sprayer's next one. While another tenant waits for
  a slot, a tenant holds at most its share (``max_loras`` over the tenants with adapter
  work, at least one): its further adapters get no place, may not push out a tenant under
  its share, and when no slot is free one of its busy adapters (the least queued work) is
  closed at once, as for a starving adapter. A tenant that had adapter work within
  :data:`RECENT_S` still counts (interactive clients send their next request right after the
  last one ends): when the slots give every such tenant one, its last adapter stays in its
  slot, safe from the other tenants' loads, so its next request waits for no load. A tenant
  at its share waits on its own adapters: one of them starving closes one of its own busy
  adapters, never another tenant's. Within a tenant the order above holds.
* **Load order and prefetch.** The ranked adapters beyond this step's places are handed to
  the gate's ``prefetch``, best first: the loads this step asked for that wait for a loader
  worker start in that order, and the next ``prefetch_depth`` others load disk → CPU tier
  on idle workers so they are loaded by the time a slot frees. Those of the tenants
  (fairness keys) placed this step come first, so a tenant's adapters that arrive together
  load together; with the fair-share policy the tenants take turns (each one's first
  adapter, in the fair order, then each one's second, ...; one still loading holds its
  turn), so a sprayer's burst of cold adapters cannot queue a neighbour's one load behind
  all of its own.

It only sees plain sequences and the :class:`AdapterGate`, so it is tested with no model.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol

from loramux.engine.sequence import Sequence
from loramux.engine.step_budget import RECENT_S


class AdapterGate(Protocol):
    """What admission asks of the adapter slot manager."""

    max_loras: int

    def acquire(self, lora_key: str, in_use: set[str]) -> bool:
        """True when ``lora_key`` sits (or was just placed) in a device slot, evicting
        nothing in ``in_use``; otherwise start loading it and return False."""

    def is_resident(self, lora_key: str) -> bool:
        """True when ``lora_key`` sits in a device slot, ready."""

    def prefetch(self, lora_keys: list[str]) -> None:
        """Called once per step, after its ``acquire`` calls: the load order, best first.
        Loads ``acquire`` started that still wait for a worker start in this order; the
        others of ``lora_keys`` start loading into the CPU tier in the background."""

    def note_running(self, lora_keys: set[str]) -> None:
        """The adapters of the running sequences now (the scheduler tells it after each
        schedule, update and abort): their slots are never evicted."""


@dataclass
class _StepView:
    """One step's adapter demand and slot holdings, as :meth:`SlotAdmission.plan` sees them."""

    busy: Counter
    """Adapter -> its running sequences."""
    queued: Counter = field(default_factory=Counter)
    """Adapter -> its waiting sequences."""
    age: dict[str, int] = field(default_factory=dict)
    """Adapter -> the most steps one of its waiting sequences was skipped."""
    tenant: dict[str, str | None] = field(default_factory=dict)
    """Waiting adapter -> its tenant (fairness key)."""
    first: dict = field(default_factory=dict)
    """Tenant -> its place in the fair order (0 = least served)."""
    wanted: list[str] = field(default_factory=list)
    """Adapters with waiting sequences and none running."""
    resident: set[str] = field(default_factory=set)
    owner: dict = field(default_factory=dict)
    """Running adapter -> its tenant."""
    held: Counter = field(default_factory=Counter)
    """Tenant -> slots its running adapters hold."""
    share: int | None = None
    """Slots a tenant may hold while others wait (fair order only)."""
    kept: dict = field(default_factory=dict)
    """Tenant -> its last adapter, idle in a slot, kept for its next request."""
    claim: Counter = field(default_factory=Counter)
    """``held`` plus the kept slots: what the other tenants see."""


class SlotAdmission:
    """The adapter side of admission (the policy is the module docstring)."""

    def __init__(self, gate: AdapterGate | None, bound: int, prefetch_depth: int = 4) -> None:
        self.gate = gate
        self.bound = bound
        self.prefetch_depth = prefetch_depth
        self.step = 0
        self.closed: dict[str, int] = {}
        """Busy adapters that admit nothing new until they drain (key → step closed)."""
        self._places: set[str] = set()
        self._recent: dict = {}  # tenant -> (clock time it last had adapter work, that adapter)
        self.clock = time.monotonic
        """Seconds (monotonic); tests put a fake clock here."""

    def plan(self, waiting: Iterable[Sequence], running: Iterable[Sequence],
             fair_order: bool = False) -> list[Sequence]:
        """Decide this step's adapters; returns the running sequences to preempt (those of
        a closed adapter that did not drain within ``bound`` steps). ``fair_order``: the
        waiting sequences come in the fair-share policy's order (first = least served), and
        slots are shared across their fairness keys."""
        self.step += 1
        self._places = set()
        running, waiting = list(running), list(waiting)
        busy = Counter(s.lora_key for s in running if s.lora_key is not None)
        for key in [k for k in self.closed if k not in busy]:
            del self.closed[key]  # drained: its slot is free for the starving adapter
        if self.gate is None:
            return []
        view = self._view(waiting, running, busy, fair_order)
        ranked = sorted(view.wanted, key=lambda k: self._rank(view, k, fair_order))
        free, tried = self._fill_places(view, ranked)
        starving = [k for k in ranked if view.age[k] >= self.bound and k not in self._places]
        if starving and free <= 0 and not self.closed and busy:
            self._close_for(view, starving[0])
        elif view.share is not None and free <= 0:
            self._close_over_share(ranked, busy, view.queued, view.owner, view.claim, view.share,
                                   view.tenant)
        self.gate.prefetch(self._load_order(ranked, tried, view.tenant, fair_order))
        return [s for s in running if s.lora_key in self.closed
                and self.step - self.closed[s.lora_key] >= self.bound]

    def _view(self, waiting: list[Sequence], running: list[Sequence], busy: Counter,
              fair_order: bool) -> _StepView:
        """The step's adapter demand and who holds the slots."""
        gate = self.gate
        v = _StepView(busy)
        for seq in waiting:
            if seq.lora_key is not None:
                v.queued[seq.lora_key] += 1
                v.tenant.setdefault(seq.lora_key, seq.fairness_key)
                v.first.setdefault(seq.fairness_key, len(v.first))
                v.age[seq.lora_key] = max(v.age.get(seq.lora_key, 0), seq.skipped_steps)
        v.wanted = [k for k in v.queued if k not in busy]
        v.resident = {k for k in v.wanted if gate.is_resident(k)}
        v.owner = {s.lora_key: s.fairness_key for s in running if s.lora_key is not None}
        v.held = Counter(v.owner[k] for k in busy)  # slots each tenant's running adapters hold
        if fair_order:
            recent = self._note_recent({**v.tenant, **v.owner})
            tenants = set(v.held) | {v.tenant[k] for k in v.wanted} | set(recent)
            v.share = self._share(gate.max_loras, tenants)
            if len(tenants) <= gate.max_loras:  # a slot for everyone: keep the idle ones.
                v.kept = {t: k for t, k in recent.items()
                          if k not in busy and k not in v.queued and gate.is_resident(k)}
        v.claim = v.held.copy()  # ... and the slots kept for them: what the others see
        for t in v.kept:
            v.claim[t] += 1
        return v

    def _rank(self, v: _StepView, key: str, fair_order: bool) -> tuple:
        """Sort key of a wanted adapter (the module docstring's order)."""
        starving = v.age[key] >= self.bound
        return (not starving, -v.age[key] if starving else 0,
                v.first[v.tenant[key]] if fair_order else 0, key not in v.resident,
                -v.queued[key], -v.age[key])

    def _fill_places(self, v: _StepView, ranked: list[str]) -> tuple[int, set[str]]:
        """Ask the gate for the free slots, best-ranked adapters first; returns the slots
        still free and the adapters asked for."""
        free = self.gate.max_loras - len(v.busy)
        loads = 0
        tried: set[str] = set()

        def others_wait(t) -> bool:
            return any(x != t for x in v.kept) or any(
                v.tenant[k] != t and k not in self._places for k in v.wanted)

        for key in ranked:
            if free <= 0:
                break
            t = v.tenant[key]
            starving = v.age[key] >= self.bound
            if v.share is not None and v.held[t] >= v.share and others_wait(t):
                continue  # its share is full while another tenant waits (starving or not)
            if key not in v.resident and loads >= free:
                continue  # no more loads than places: the rest is prefetch's
            tried.add(key)
            # the others' kept slots stay (kept only when every tenant has a slot, so one
            # not kept by another is always there for t)
            keep = set(v.busy) | self._places | {k for x, k in v.kept.items() if x != t}
            if not starving:  # only a starving adapter displaces queued work ...
                under = v.share is not None and v.claim[t] < v.share
                # ... or, for a tenant under its share, that of tenants within theirs
                keep |= {k for k in v.resident - {key}
                         if not under or v.claim[v.tenant[k]] < v.share or v.tenant[k] == t}
            if self.gate.acquire(key, keep):
                self._places.add(key)
                v.held[t] += 1
                v.claim[t] += 1
                free -= 1
            else:
                loads += 1
        return free, tried

    def _close_for(self, v: _StepView, starving: str) -> None:
        """No slot is free for the starving adapter: close the busy adapter with the least
        queued work (then the fewest running sequences); a tenant at its share waits on its
        own adapters."""
        t = v.tenant[starving]
        pool = list(v.busy)
        if v.share is not None and v.held[t] >= v.share:
            pool = [k for k in v.busy if v.owner[k] == t]
        if pool:
            victim = min(pool, key=lambda k: (v.queued[k], v.busy[k], k))
            self.closed[victim] = self.step

    def _load_order(self, ranked: list[str], tried: set[str], tenant: dict,
                    fair_order: bool) -> list[str]:
        """The adapters to load, best first (the docstring's load order): every one asked
        for this step (``tried``) beyond its places, and the next ``prefetch_depth``."""
        placing = {tenant[k] for k in tried}
        rest = [k for k in ranked if k not in self._places]
        turn: dict[str, int] = {}
        seen: Counter = Counter()
        for k in rest:  # the k-th adapter of its tenant, in rank order
            turn[k] = seen[tenant[k]] if fair_order else 0
            seen[tenant[k]] += 1
        place = {k: i for i, k in enumerate(rest)}
        rest.sort(key=lambda k: (tenant[k] not in placing, turn[k], place[k]))
        others = [k for k in rest if k not in tried][: self.prefetch_depth]
        return [k for k in rest if k in tried or k in others]

    def _note_recent(self, adapters: dict) -> dict:
        """Tenant -> its last adapter, for the tenants with adapter work within RECENT_S;
        ``adapters``: this step's adapter -> tenant, waiting and running."""
        now = self.clock()
        for key, t in adapters.items():
            self._recent[t] = (now, key)
        for t in [t for t, (seen, _) in self._recent.items() if now - seen > RECENT_S]:
            del self._recent[t]
        return {t: k for t, (_, k) in self._recent.items()}

    @staticmethod
    def _share(slots: int, tenants: set) -> int:
        """Slots one tenant may hold while others wait: an even split, at least one."""
        return max(1, slots // max(1, len(tenants)))

    def _close_over_share(self, ranked, busy, queued, owner, held, share, tenant) -> None:
        """No slot is free and a tenant under its share waits: close a busy adapter of the
        tenant furthest over its share (least queued work first), unless one of its adapters
        drains already."""
        waiting_under = [k for k in ranked if k not in self._places and held[tenant[k]] < share]
        if not waiting_under:
            return
        over = [t for t in held if held[t] > share]
        if not over:
            return
        t = max(over, key=lambda x: (held[x], str(x)))
        if any(owner.get(k) == t for k in self.closed):
            return
        victim = min((k for k in busy if owner[k] == t), key=lambda k: (queued[k], busy[k], k))
        self.closed[victim] = self.step

    def allows(self, seq: Sequence, in_use: set[str]) -> bool:
        """May ``seq`` be admitted this step as far as its adapter goes?"""
        key = seq.lora_key
        if key is None:
            return True
        if key in self.closed:
            return False
        return key in in_use or key in self._places

    def ready(self, waiting: Iterable[Sequence]) -> list[Sequence]:
        """The ``waiting`` sequences a step could start now as far as adapters go: the base
        model's and those whose adapter is in a slot (one waiting on a load cannot be helped by
        a larger step: the goodput count leaves it out, ``engine/goodput.py``)."""
        gate = self.gate
        return [s for s in waiting if s.lora_key is None or gate is None or gate.is_resident(s.lora_key)]
