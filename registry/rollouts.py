"""Rollouts: how requests for an adapter's plain name spread over its versions.

A rollout is integer percentages per version summing to 100 (``{3: 90, 4: 10}``) and a
*sticky* mode that keeps one caller on one version:

* ``user``: the request's OpenAI ``user`` field; requests without one are spread by weight
  one by one;
* ``key``: the API key (its public prefix), so every request of one key lands together;
* ``none``: every request is drawn by weight on its own.

A sticky caller is hashed with the adapter's identity into one of 100 buckets; versions
own consecutive bucket ranges in version order, so moving weight to the newest version
moves only the callers in the buckets it gains (a canary's users stay on it while it
grows). Whoever picks (a gateway, an engine) gets the same version for the same caller.

An adapter without an explicit rollout *follows the latest*: the newest version takes every
request and each upload moves there.

A rollback puts every request on one version (:attr:`Rollout.rollback_to`): while one
version is live, the version that was live before it (``previous_live``, kept across
changes by :func:`next_previous_live`); during a split, the oldest version that carries
weight, or the version live before the split when it is older still (a canary is dropped,
the stable version keeps everything). Pure: no I/O.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from loramux.registry.errors import InvalidRollout

STICKY_MODES = ("user", "key", "none")
BUCKETS = 100


@dataclass(frozen=True)
class Rollout:
    """The split of one adapter's traffic (see the module doc)."""

    weights: tuple[tuple[int, int], ...]
    """``(version, percent)`` in version order; the percents sum to 100."""
    sticky: str = "user"
    follow_latest: bool = False
    """True: no explicit rollout, the newest version takes everything (``weights`` is it)."""
    previous_live: int | None = None

    @property
    def versions(self) -> tuple[int, ...]:
        """Every version the rollout names (a weight of 0 included)."""
        return tuple(v for v, _ in self.weights)

    @property
    def live(self) -> int | None:
        """The one version taking every request, or None for a split."""
        full = [v for v, w in self.weights if w == BUCKETS]
        return full[0] if full else None

    def weight(self, version: int) -> int:
        return dict(self.weights).get(version, 0)

    @property
    def rollback_to(self) -> int | None:
        """The version a rollback puts 100% on (see the module doc); None: nothing to go to."""
        if self.live is not None:
            return self.previous_live
        weighted = [v for v, w in self.weights if w > 0]
        if self.previous_live is not None:
            weighted.append(self.previous_live)
        return min(weighted) if weighted else None

    def choose(self, salt: str, sticky_value: str | None, rng: random.Random | None = None) -> int:
        """The version for one request. ``salt`` identifies the adapter (tenant and name);
        ``sticky_value`` is the caller's ``user`` or key prefix per :attr:`sticky` (None:
        drawn by weight with ``rng``)."""
        if len(self.weights) == 1:
            return self.weights[0][0]
        if sticky_value is None or self.sticky == "none":
            point = (rng or random).randrange(BUCKETS)
        else:
            point = bucket(salt, sticky_value)
        upto = 0
        for version, weight in self.weights:
            upto += weight
            if point < upto:
                return version
        return self.weights[-1][0]  # unreachable: the weights sum to BUCKETS

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly: weights keyed by the version number as a string (as sent)."""
        return {"weights": {str(v): w for v, w in self.weights}, "sticky": self.sticky,
                "follow_latest": self.follow_latest, "rollback_to": self.rollback_to}


def bucket(salt: str, value: str) -> int:
    """The bucket (0..99) of one sticky caller of one adapter."""
    digest = hashlib.sha256(f"{salt}\x00{value}".encode()).digest()
    return int.from_bytes(digest[:8], "big") % BUCKETS


def parse_weights(weights: Any) -> tuple[tuple[int, int], ...]:
    """Checked ``(version, percent)`` pairs from a JSON object ``{"3": 90, "4": 10}``:
    positive integer versions, integer percents 0..100 (not booleans, not floats) summing
    to 100, at least one of them above 0. Raises :class:`InvalidRollout` naming the field."""
    if not isinstance(weights, Mapping) or not weights:
        raise InvalidRollout('weights must be a non-empty JSON object {"<version>": percent}')
    out: dict[int, int] = {}
    for key, value in weights.items():
        text = str(key)
        if not text.isascii() or not text.isdigit() or len(text) > 9 or int(text) < 1:
            raise InvalidRollout(f"weights: {text[:20]!r} is not a version number (1, 2, ...)",
                                 param=f"weights.{text[:20]}")
        version = int(text)
        if version in out:
            raise InvalidRollout(f"weights: version {version} appears twice",
                                 param=f"weights.{version}")
        if isinstance(value, bool) or not isinstance(value, int):
            raise InvalidRollout(f"weights: the weight of version {version} must be an integer "
                                 f"percent, got {value!r}"[:200], param=f"weights.{version}")
        if not 0 <= value <= BUCKETS:
            raise InvalidRollout(f"weights: the weight of version {version} must be between 0 "
                                 f"and 100, got {value}", param=f"weights.{version}")
        out[version] = value
    total = sum(out.values())
    if total != BUCKETS:
        raise InvalidRollout(f"weights must sum to 100, these sum to {total}")
    return tuple(sorted(out.items()))


def check_sticky(sticky: Any) -> str:
    if sticky not in STICKY_MODES:
        raise InvalidRollout(f"sticky must be one of {', '.join(STICKY_MODES)}, got "
                             f"{str(sticky)[:40]!r}", param="sticky")
    return sticky


def next_previous_live(old: Rollout, new_weights: tuple[tuple[int, int], ...]) -> int | None:
    """``previous_live`` once ``new_weights`` replace ``old``'s: entering a split, the
    version live before it; a single live version after a split, what a rollback of that
    split would have chosen; after another single version, that version (never the one
    now live: then the earlier one is kept, or none)."""
    new_live = next((v for v, w in new_weights if w == BUCKETS), None)
    if new_live is None:
        return old.live if old.live is not None else old.previous_live
    before = old.live if old.live is not None else old.rollback_to
    if before == new_live:
        before = old.previous_live if old.previous_live != new_live else None
    return before
