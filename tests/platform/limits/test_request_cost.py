"""Request cost is computed one way (``RequestCost.estimate``) at a server and a gateway."""

from __future__ import annotations

from loramux.platform.cluster.request_body import request_cost
from loramux.platform.limits.tenant import RequestCost


def test_estimate_charges_every_sequence_and_adds_up():
    one = RequestCost.estimate(10, 5, n=2, best_of=3)
    assert one == RequestCost(10 + 5 * 3, 3)
    assert one + RequestCost.estimate(4, 5, n=2, best_of=3) == RequestCost(25 + 4 + 5 * 3, 6)


def test_gateway_cost_is_the_same_estimate():
    body = {"prompt": "x" * 40, "max_tokens": 7, "n": 2}
    assert request_cost(body) == RequestCost.estimate(40 // 4 + 1, 7, n=2, best_of=2)
