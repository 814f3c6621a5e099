"""The goodput objective (``engine/goodput.py``) on a simulated clock: the cap it picks meets as
many objectives as a search of every cap finds (random small cases), and the policy's two
directions — prompts about to miss while streams have slack get the step, streams about to miss
keep the floor."""

from __future__ import annotations

import random

import pytest

from loramux.engine.goodput import PromptDemand, best_prompt_cap, met_count, stream_slack


def _cost(c0, c_tok):
    return lambda p: c0 + c_tok * p


@pytest.mark.parametrize("seed", range(200))
def test_best_cap_is_the_brute_force_maximum(seed):
    rng = random.Random(seed)
    floor = rng.randint(1, 40)
    ceiling = floor + rng.randint(0, 300)
    cost = _cost(rng.uniform(0.01, 0.1), rng.uniform(1e-4, 2e-3))
    now = 100.0
    prompts = [PromptDemand(rng.randint(1, 200), now + rng.uniform(0, 1.5)) for _ in range(rng.randint(0, 6))]
    slacks = [rng.uniform(-0.2, 0.6) for _ in range(rng.randint(0, 8))]
    lowest = rng.choice([floor, rng.randint(1, floor)])
    cap = best_prompt_cap(floor, ceiling, cost, prompts, slacks, now, lowest=lowest)
    counts = {p: met_count(p, floor, cost, prompts, slacks, now) for p in range(lowest, max(floor, ceiling) + 1)}
    best = max(counts.values())
    assert lowest <= cap <= max(floor, ceiling)
    assert counts[cap] == best
    # the nearest the floor among caps as good (below it only when that meets more)
    assert abs(cap - floor) == min(abs(p - floor) for p, c in counts.items() if c == best)


def test_prompt_about_to_miss_gets_the_step_when_streams_have_slack():
    cost = _cost(0.05, 0.001)  # a 600-token prompt alone: 0.65 s
    now = 10.0
    prompt = [PromptDemand(600, now + 0.8)]  # at the floor's 64 a step it needs 10 steps: 1.1 s
    cap = best_prompt_cap(64, 2048, cost, prompt, [1.0, 1.0], now)
    assert cap == 408  # the least that meets it: 0.458 s now, then 3 floor steps of 0.114 s
    assert met_count(cap, 64, cost, prompt, [1.0, 1.0], now) == 3
    assert met_count(cap - 1, 64, cost, prompt, [1.0, 1.0], now) == 2
    # the same prompt with streams that would miss their TPOT by the longer step: a tie of one
    # prompt against two streams keeps the floor
    assert best_prompt_cap(64, 2048, cost, prompt, [0.1, 0.1], now) == 64
    # no deadline pressure: the floor (smoothest streams)
    assert best_prompt_cap(64, 2048, cost, [PromptDemand(600, now + 5.0)], [1.0], now) == 64


def test_stream_slack():
    # 10 tokens out in 1 s since the first, 20 more at 0.05 s: 0.1 * 29 - 1 - 1 = 0.9
    assert stream_slack(11.0, 10.0, 10, 20, 0.1, 0.05) == pytest.approx(0.9)
    assert stream_slack(11.0, 10.0, 10, 20, 0.03, 0.05) < 0  # misses already


def _warm_budget(**kw):
    """A step budget whose cost model learnt c0 + c_dec * rows + c_pre * prompt tokens on a fake clock."""
    from loramux.engine.step_budget import WARM_STEPS, StepBudget, StepShape

    budget = StepBudget(token_budget=2048, **kw)
    for i in range(WARM_STEPS + 30):
        rows, pre = 1 + i % 5, (i * 37) % 300
        budget.observe(StepShape(rows, pre, 0), 0.02 + 0.004 * rows + 0.001 * pre)
    budget.clock = lambda: 100.0
    return budget


def _stream(name, out, max_tokens, first_token_time):
    from loramux.engine.sampling_params import SamplingParams
    from loramux.engine.sequence import Sequence

    seq = Sequence(name, 0, list(range(1, 9)), SamplingParams(max_tokens=max_tokens), fairness_key="k")
    for t in range(out):
        seq.append_token(10 + t)
    seq.num_computed_tokens = seq.num_tokens - 1
    seq.first_token_time = first_token_time
    return seq


def _prompt(tokens, arrival):
    from loramux.engine.sampling_params import SamplingParams
    from loramux.engine.sequence import Sequence

    return Sequence("p", 0, list(range(1, tokens + 1)), SamplingParams(max_tokens=16), fairness_key="k",
                    arrival_time=arrival)


def test_the_step_budget_gives_a_prompt_about_to_miss_more_of_the_step():
    """Wired into the step budget (fake clock at 100 s): a 400-token prompt due in 0.48 s gets
    more than the ITL target's chunk while the streams have slack; with streams that would miss
    their TPOT, or a prompt not yet pressed, the chunk stays the ITL target's."""
    budget = _warm_budget(target_itl_ms=60, target_ttft_ms=500)
    streams = [_stream(f"s{i}", 20, 400, first_token_time=99.6) for i in range(2)]  # fast so far
    floor = _warm_budget(target_itl_ms=60).plan(streams, {"k"}, 0).prefill_tokens
    pressed = budget.plan(streams, {"k"}, 0, prompts=[_prompt(400, arrival=99.98)])
    assert floor < pressed.prefill_tokens <= 400
    # streams with 0.1 s of slack would miss their TPOT by the longer step: two against one
    tight = [_stream(f"s{i}", 20, 400, first_token_time=98.58) for i in range(2)]
    assert budget.plan(tight, {"k"}, 0, prompts=[_prompt(400, arrival=99.98)]).prefill_tokens == floor
    assert budget.plan(streams, {"k"}, 0, prompts=[_prompt(400, arrival=100.0 + 30)]).prefill_tokens == floor


def test_a_keys_own_objectives_take_part_in_the_count():
    """A tenant's quotas set its own TTFT objective (``KeyObjectives``): the same prompt, not
    pressed under the engine's 30 s objective, is pressed under its tenant's 480 ms one."""
    budget = _warm_budget(target_itl_ms=60, target_ttft_ms=30_000)
    streams = [_stream(f"s{i}", 20, 400, first_token_time=99.6) for i in range(2)]
    floor = budget.plan(streams, {"k"}, 0, prompts=[_prompt(400, arrival=99.98)]).prefill_tokens
    budget.objectives.set("k", 500, None)
    pressed = budget.plan(streams, {"k"}, 0, prompts=[_prompt(400, arrival=99.98)]).prefill_tokens
    assert floor < pressed <= 400
    budget.objectives.set("k", None, None)  # dropped: the engine's again
    assert budget.plan(streams, {"k"}, 0, prompts=[_prompt(400, arrival=99.98)]).prefill_tokens == floor


def test_a_prompt_waiting_on_its_adapters_load_is_left_out_of_the_count():
    """A step cannot start a prompt whose adapter is still loading, so a larger step cannot
    help it: the count sees only prompts of the base model and of resident adapters."""
    from loramux.engine.lora.admission import SlotAdmission

    class Gate:
        def is_resident(self, key):
            return key == "hot"

    seqs = [_prompt(10, 1.0), _prompt(10, 1.0), _prompt(10, 1.0)]
    seqs[1].lora_key, seqs[2].lora_key = "hot", "cold"
    assert SlotAdmission(Gate(), 4).ready(seqs) == seqs[:2]
    assert SlotAdmission(None, 4).ready(seqs) == seqs
