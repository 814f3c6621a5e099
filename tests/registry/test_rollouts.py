"""The pure rollout policy: weighted, sticky, stable while a canary grows."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from loramux.registry.errors import InvalidRollout
from loramux.registry.rollouts import (
    Rollout,
    bucket,
    check_sticky,
    next_previous_live,
    parse_weights,
)


@pytest.mark.parametrize("weights, match", [
    ({"1": 90, "2": 20}, "sum to 100"),
    ({"1": 110, "2": -10}, "between 0 and 100"),
    ({"1": 90.0, "2": 10}, "integer percent"),
    ({"1": 50.5, "2": 49.5}, "integer percent"),
    ({"1": True, "2": 99}, "integer percent"),
    ({"1": "90", "2": 10}, "integer percent"),
    ({"one": 100}, "not a version number"),
    ({"0": 100}, "not a version number"),
    ({}, "non-empty"),
    ([1, 2], "non-empty"),
])
def test_bad_weights_are_refused(weights, match):
    """The checks behind ``RegistryService.set_rollout`` (which changes nothing on a refusal:
    tests/registry/test_versions.py runs a few of these through every backend)."""
    with pytest.raises(InvalidRollout, match=match):
        parse_weights(weights)


def test_an_unknown_sticky_mode_is_refused():
    with pytest.raises(InvalidRollout, match="sticky must be one of"):
        check_sticky("random")
    assert check_sticky("user") == "user"


def test_a_thousand_users_split_within_three_points_and_stick():
    rollout = Rollout(parse_weights({"3": 90, "4": 10}), "user")
    users = [f"user-{random.Random(7).getrandbits(64)}-{i}" for i in range(1000)]
    picks = {u: rollout.choose("1/sql-lora", u) for u in users}
    share = Counter(picks.values())[4] / len(users)
    assert abs(share - 0.10) <= 0.03, share
    assert all(rollout.choose("1/sql-lora", u) == v for u, v in picks.items())  # sticky


def test_requests_without_a_sticky_value_are_drawn_by_weight():
    rollout = Rollout(parse_weights({"1": 90, "2": 10}), "user")
    rng = random.Random(11)
    share = Counter(rollout.choose("t/a", None, rng) for _ in range(1000))[2] / 1000
    assert abs(share - 0.10) <= 0.03
    none = Rollout(rollout.weights, "none")
    assert len({none.choose("t/a", "same-user", rng) for _ in range(200)}) == 2


def test_a_growing_canary_keeps_its_users():
    users = [f"u{i}" for i in range(2000)]
    small = Rollout(parse_weights({"3": 90, "4": 10}))
    large = Rollout(parse_weights({"3": 70, "4": 30}))
    on_canary = {u for u in users if small.choose("s", u) == 4}
    assert on_canary and all(large.choose("s", u) == 4 for u in on_canary)


def test_adapters_split_independently():
    users = [f"u{i}" for i in range(400)]
    a = [bucket("1/a", u) < 50 for u in users]
    b = [bucket("1/b", u) < 50 for u in users]
    assert 0.35 < sum(x == y for x, y in zip(a, b, strict=True)) / len(users) < 0.65


def test_previous_live_and_the_rollback_target():
    live3 = Rollout(((3, 100),), previous_live=2)
    assert live3.rollback_to == 2
    assert next_previous_live(live3, ((3, 90), (4, 10))) == 3  # entering a split from 3
    split = Rollout(((3, 90), (4, 10)), previous_live=3)
    assert split.rollback_to == 3  # the canary goes, the stable version takes all
    assert Rollout(((3, 10), (4, 90)), previous_live=3).rollback_to == 3
    assert Rollout(((4, 50), (5, 50)), previous_live=3).rollback_to == 3  # moved off 3 wholly
    assert Rollout(((1, 90), (2, 10)), previous_live=2).rollback_to == 1  # after auto-promotion
    assert next_previous_live(split, ((3, 100),)) is None  # rolled back onto it
    assert next_previous_live(split, ((4, 100),)) == 3  # promoted: back to 3 on rollback
    assert next_previous_live(live3, ((4, 100),)) == 3
    assert next_previous_live(live3, ((3, 100),)) == 2  # no change
