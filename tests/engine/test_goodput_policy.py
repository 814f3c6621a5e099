"""The goodput objective (``engine/goodput.py``) on a simulated clock: the cap it picks meets as
many objectives as a search of every cap finds (random small cases), and the policy's two
directions — prompts about to miss while streams have slack get the step, streams about to miss
keep the floor."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from loramux.engine.goodput import (
    PromptDemand,
    PromptInflow,
    StreamDemand,
    best_prompt_cap,
    first_prompt_whole,
    keeping_pace,
    met_count,
    stream_slack,
)


def _cost(c0, c_tok):
    return lambda p: c0 + c_tok * p


def _random_case(rng, span: int, longest: int, fewest_prompts: int, arriving: bool):
    """A small random case: the floor, a ceiling up to ``span`` above it, a linear step cost,
    the clock, 1..6 prompts of up to ``longest`` tokens (at least ``fewest_prompts``) and up to
    8 streams (with prompt tokens arriving during their lives where ``arriving``)."""
    floor = rng.randint(1, 40)
    ceiling = floor + rng.randint(0, span)
    cost = _cost(rng.uniform(0.01, 0.1), rng.uniform(1e-4, 2e-3))
    now = 100.0
    prompts = [PromptDemand(rng.randint(1, longest), now + rng.uniform(0, 1.5))
               for _ in range(rng.randint(fewest_prompts, 6))]
    streams = [StreamDemand(rng.uniform(-0.2, 0.6), rng.randint(0, 30), rng.randint(0, 300) if arriving else 0)
               for _ in range(rng.randint(0, 8))]
    return floor, ceiling, cost, now, prompts, streams


@pytest.mark.parametrize("seed", range(200))
def test_best_cap_is_the_brute_force_maximum(seed):
    rng = random.Random(seed)
    floor, ceiling, cost, now, prompts, slacks = _random_case(rng, 300, 200, 0, arriving=False)
    lowest = rng.choice([floor, rng.randint(1, floor)])
    cap = best_prompt_cap(floor, ceiling, cost, prompts, slacks, now, lowest=lowest)
    counts = {p: met_count(p, floor, cost, prompts, slacks, now) for p in range(lowest, max(floor, ceiling) + 1)}
    best = max(counts.values())
    assert lowest <= cap <= max(floor, ceiling)
    assert counts[cap] == best
    # the nearest the floor among caps as good (below it only when that meets more)
    assert abs(cap - floor) == min(abs(p - floor) for p, c in counts.items() if c == best)


@pytest.mark.parametrize("seed", range(100))
def test_the_first_prompt_whole_costs_no_stream_and_no_objective(seed):
    """The first prompt whole replaces the count's cap only where, with every later step taking
    as much, no stream that met its TPOT misses it and no fewer objectives are met; otherwise the
    count's cap stands."""
    floor, ceiling, cost, now, prompts, streams = _random_case(random.Random(seed), 400, 300, 1, arriving=True)
    cap = best_prompt_cap(floor, ceiling, cost, prompts, streams, now)
    got = first_prompt_whole(cap, floor, ceiling, cost, prompts, streams, now)
    assert got in (cap, min(ceiling, prompts[0].tokens))
    if got != cap:
        assert got > cap
        assert met_count(got, got, cost, prompts, streams, now) >= met_count(cap, floor, cost, prompts, streams, now)
        assert met_count(got, got, cost, [], streams, now, sum(p.tokens for p in prompts)) >= met_count(
            cap, floor, cost, [], streams, now, sum(p.tokens for p in prompts))


def test_prompt_about_to_miss_gets_the_step_when_streams_have_slack():
    cost = _cost(0.05, 0.001)  # a 600-token prompt alone: 0.65 s
    now = 10.0
    prompt = [PromptDemand(600, now + 0.8)]  # at the floor's 64 a step it needs 10 steps: 1.1 s
    relaxed = [StreamDemand(1.0, 2), StreamDemand(1.0, 2)]
    cap = best_prompt_cap(64, 2048, cost, prompt, relaxed, now)
    assert cap == 408  # the least that meets it: 0.458 s now, then 3 floor steps of 0.114 s
    assert met_count(cap, 64, cost, prompt, relaxed, now) == 3
    assert met_count(cap - 1, 64, cost, prompt, relaxed, now) == 2
    # the same prompt beside streams with two tokens left, whose TPOT pays for 0.1 s of prompt
    # work (128 tokens at the floor's pace, 64+64): the longer step makes them miss; a tie of
    # one prompt against two streams keeps the floor
    tight = [StreamDemand(0.13, 2), StreamDemand(0.13, 2)]
    assert best_prompt_cap(64, 2048, cost, prompt, tight, now) == 64
    # no deadline pressure: the floor (smoothest streams)
    assert best_prompt_cap(64, 2048, cost, [PromptDemand(600, now + 5.0)], relaxed[:1], now) == 64


def test_prompt_work_a_stream_shares_anyway_costs_it_nothing_sooner():
    """Streams that run for the whole queue's prefill at the floor's pace pay for all of it
    either way: computing it sooner leaves their mean inter-token time as it was, so the
    prompt gets the step even though the streams' slack is smaller than the longer step."""
    cost = _cost(0.05, 0.001)
    now = 10.0
    prompt = [PromptDemand(600, now + 0.8)]
    long_lived = [StreamDemand(0.62, 40), StreamDemand(0.62, 40)]  # 40 steps x 64 > 600 queued
    assert best_prompt_cap(64, 2048, cost, prompt, long_lived, now) == 408
    # streams with 2 tokens left absorb 128 tokens at the floor (0.128 s) but 472 with the
    # prompt's cap: with 0.3 s of slack they would miss — they keep the floor
    assert best_prompt_cap(64, 2048, cost, prompt, [StreamDemand(0.3, 2)] * 2, now) == 64


def test_keeping_pace():
    # 1000 prompt tokens/s, steps of 0.1 s + 0.5 ms a token: 200 tokens a step take 0.2 s
    assert keeping_pace(1000.0, 0.1, 0.0005) == 200
    assert keeping_pace(0.0, 0.1, 0.0005) == 0
    assert keeping_pace(2000.0, 0.1, 0.0005) >= 1 << 30  # no step size keeps pace


def test_prompt_inflow_counts_each_prompt_once_over_its_window():
    def seq(seq_id, tokens):
        return SimpleNamespace(seq_id=seq_id, num_tokens=tokens, num_computed_tokens=0)

    inflow = PromptInflow()
    a, b = seq(1, 100), seq(2, 50)
    assert inflow.observe(0.0, [a]) == 0.0  # no time observed yet
    assert inflow.observe(1.0, [a, b]) == pytest.approx(150.0)
    assert inflow.observe(5.0, [a, b]) == pytest.approx(30.0)  # the same prompts: nothing new
    assert inflow.observe(12.0, [b]) == 0.0  # both arrivals left the 10 s window
    assert inflow.observe(13.0, [b, a]) == pytest.approx(10.0)  # a again (recomputed): work again


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
    more than the ITL target's chunk while the streams have slack; beside streams that would
    miss their TPOT, only what their slack pays for; not yet pressed, the ITL target's chunk
    while another key has work, and the prompt whole for a key alone."""
    budget = _warm_budget(target_itl_ms=60, target_ttft_ms=500)
    streams = [_stream(f"s{i}", 20, 400, first_token_time=99.6) for i in range(2)]  # fast so far
    floor = _warm_budget(target_itl_ms=60).plan(streams, {"k"}, 0).prefill_tokens
    pressed = budget.plan(streams, {"k"}, 0, prompts=[_prompt(400, arrival=99.98)])
    assert floor < pressed.prefill_tokens <= 400
    # streams with 2 tokens left whose TPOT pays for 0.2 s of prompt work: at the floor they
    # share 62 prompt tokens (0.06 s), with the prompt whole all 400: two against one, pressed
    # or not
    tight = [_stream(f"s{i}", 20, 22, first_token_time=98.996) for i in range(2)]
    for prompts in ([_prompt(400, arrival=99.98)], [_prompt(400, arrival=100.0 + 30)]):
        assert budget.plan(tight, {"k"}, 0, prompts=prompts).prefill_tokens == floor
    # a prompt not pressed: the ITL target's chunk (the operator set the target: it holds every
    # step); with a derived target, a key alone beside streams with slack takes it whole
    later = [_prompt(400, arrival=100.0 + 30)]
    assert budget.plan(streams, {"k"}, 0, prompts=later).prefill_tokens == floor
    assert _warm_budget(target_ttft_ms=500).plan(streams, {"k"}, 0, prompts=later).prefill_tokens == 400


def test_a_key_alone_finishes_its_first_prompt_a_step_when_no_objective_pays():
    """Among caps that meet as many objectives, a key alone under a derived ITL target takes its
    first prompt whole (first tokens a prompt a step, as vLLM lets a prompt in whole), never the
    whole queue at once: the second prompt waits for the next step. Another key with work, a
    target the operator set, or one the tenant's quota sets: the target's chunk."""
    streams = [_stream(f"s{i}", 20, 400, first_token_time=99.6) for i in range(2)]
    floor = _warm_budget().plan(streams, {"k"}, 0).prefill_tokens
    two = [_prompt(300, 99.9), _prompt(500, 99.9)]
    budget = _warm_budget(target_ttft_ms=30_000)  # no prompt is pressed
    assert floor < 300 and budget.plan(streams, {"k"}, 0, prompts=two).prefill_tokens == 300
    # a first prompt shorter than the floor's chunk: the floor (the next prompt starts too)
    assert budget.plan(streams, {"k"}, 0, prompts=[_prompt(10, 99.9), _prompt(500, 99.9)]).prefill_tokens == floor
    assert budget.plan(streams, {"k", "j"}, 0, prompts=two).prefill_tokens < 300
    assert _warm_budget(target_itl_ms=140, target_ttft_ms=30_000).plan(
        streams, {"k"}, 0, prompts=two).prefill_tokens < 300
    budget.objectives.set("k", None, 140)
    assert budget.plan(streams, {"k"}, 0, prompts=two).prefill_tokens < 300


def test_a_keys_own_objectives_take_part_in_the_count():
    """A tenant's quotas set its own TTFT objective (``KeyObjectives``): the same prompt, not
    pressed under the engine's 30 s objective, is pressed under its tenant's 480 ms one."""
    budget = _warm_budget(target_itl_ms=60, target_ttft_ms=30_000)
    streams = [_stream(f"s{i}", 20, 400, first_token_time=99.6) for i in range(2)]
    keys = {"k", "j"}  # another key has work: ties keep the floor
    floor = budget.plan(streams, keys, 0, prompts=[_prompt(400, arrival=99.98)]).prefill_tokens
    budget.objectives.set("k", 500, None)
    pressed = budget.plan(streams, keys, 0, prompts=[_prompt(400, arrival=99.98)]).prefill_tokens
    assert floor < pressed <= 400
    budget.objectives.set("k", None, None)  # dropped: the engine's again
    assert budget.plan(streams, keys, 0, prompts=[_prompt(400, arrival=99.98)]).prefill_tokens == floor


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


def test_the_floor_keeps_pace_with_arriving_prompts_only_for_a_key_alone():
    """800 prompt tokens arrived in the last second (0.8 s of prefill a second): the ITL
    target's 31-token chunk would let the queue grow without bound, so a key alone gets the
    pace (steps of 0.028 s + 0.001 s a token: 112 tokens); while another key waits, the
    target holds (a flooder's arrivals must not stretch its neighbours' steps)."""
    def cap(keys, arrivals: bool) -> int:
        budget = _warm_budget(target_itl_ms=60, target_ttft_ms=30_000)  # no prompt is pressed
        streams = [_stream(f"s{i}", 20, 400, first_token_time=99.6) for i in range(2)]
        # a first prompt within any floor's chunk (a key alone would take a longer one whole)
        first, second = _prompt(20, 100.0), _prompt(780, 100.0)
        if arrivals:  # seen over a second (no time observed: no inflow known)
            budget.plan(streams, keys, 0, prompts=[first])
            budget.clock = lambda: 101.0
        return budget.plan(streams, keys, 0, prompts=[first, second]).prefill_tokens

    floor = cap({"k"}, arrivals=False)
    assert floor == 31
    assert 108 <= cap({"k"}, arrivals=True) <= 116  # the fitted costs are within a percent
    assert cap({"k", "j"}, arrivals=True) == cap({"k", "j"}, arrivals=False)
