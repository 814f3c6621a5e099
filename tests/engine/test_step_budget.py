"""The step-time budget with a fake clock: a known linear step cost stands in for the
machine; every planned step is 'measured' with it and fed back to the scheduler."""

from __future__ import annotations

import pytest
from support import scheduler_harness as harness

from loramux.engine.block_manager import KVCacheManager
from loramux.engine.config import SchedulerConfig
from loramux.engine.fairness import fair_rows
from loramux.engine.sampling_params import SamplingParams
from loramux.engine.scheduler import Scheduler
from loramux.engine.sequence import Sequence
from loramux.engine.step_budget import (
    ALONE_EFFICIENCY,
    ALONE_MULTIPLE,
    COLD_CHUNK_TOKENS,
    CONTENTION_SHARE,
    DEFAULT_MULTIPLE,
    MIN_CHUNK_TOKENS,
    RECENT_S,
    WARM_STEPS,
    StepBudget,
    StepCostModel,
    StepShape,
)
from loramux.engine.step_data import SchedulerOutput

C0, C_DEC, C_PRE, C_AD = 0.010, 0.002, 0.0005, 0.003


def fake_seconds(plan: SchedulerOutput) -> float:
    """The fake machine: a step's wall time from what it carries."""
    decode = sum(1 for s in plan.scheduled if not s.is_prefill)
    prefill = sum(s.num_new_tokens for s in plan.scheduled if s.is_prefill)
    adapters = len({s.lora_key for s in plan.scheduled if s.lora_key is not None})
    return C0 + C_DEC * decode + C_PRE * prefill + C_AD * adapters


def make_seq(name: str, key: str, prompt_len: int = 8, max_tokens: int = 10_000) -> Sequence:
    return Sequence(name, 0, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens),
                    fairness_key=key)


def step(sched: Scheduler) -> SchedulerOutput:
    """Plan a step, 'run' it on the fake clock, feed the measurement back."""
    budget = sched.budget
    if budget is not None and not hasattr(budget, "fake_now"):
        budget.fake_now = 0.0
        budget.clock = lambda: budget.fake_now
    plan, _ = harness.step(sched)
    sched.observe_step(plan, fake_seconds(plan))
    if budget is not None:
        budget.fake_now += fake_seconds(plan)
    return plan


def make_scheduler(**config) -> Scheduler:
    return harness.make_scheduler(SchedulerConfig(max_num_seqs=512, **config), KVCacheManager(4096, 16), 4096)


def test_cost_model_learns_a_linear_machine():
    model = StepCostModel()
    shapes = [StepShape(d, p, a) for d in (1, 7, 30, 64) for p in (0, 100) for a in (0, 2)]
    for shape in shapes * 3:
        model.observe(shape, C0 + C_DEC * shape.decode_rows + C_PRE * shape.prefill_tokens
                      + C_AD * shape.adapters)
    assert model.warm
    for got, want in zip(model.coef, (C0, C_DEC, C_PRE, C_AD), strict=True):
        assert abs(got - want) < 1e-4
    budget = StepBudget(None, model)
    assert abs(budget.target() - DEFAULT_MULTIPLE * (C0 + C_DEC)) < 1e-4


def test_cost_model_stays_unbiased_when_features_move_together():
    """Sustained drafting: decode rows and drafted tokens rise and fall together, and step
    times are noisy. The fit must still predict what the steps cost (clipping the
    unconstrained least squares at zero predicted these 3x too long, inflating the derived
    ITL target and the prompt cap with it)."""
    import numpy as np

    for seed in (0, 1, 2, 42):
        rng = np.random.default_rng(seed)
        model = StepCostModel()
        for i in range(12):
            shape = StepShape(2, 200 if i % 3 == 0 else 0, 0)
            model.observe(shape, C0 + C_DEC * 2 + C_PRE * shape.prefill_tokens)
        seen = []
        for _ in range(200):
            rows = int(rng.integers(10, 14))
            shape = StepShape(rows, 0, 0, 3 * rows + int(rng.integers(-2, 3)))
            seconds = (C0 + C_DEC * rows + 0.0004 * shape.draft_tokens) * rng.lognormal(0, 0.3)
            model.observe(shape, seconds)
            seen.append((shape, seconds))
        recent = seen[-30:]
        bias = sum(model.predict(s) for s, _ in recent) / sum(t for _, t in recent)
        assert 0.85 < bias < 1.15, (seed, bias, model.coef)
        assert all(c >= 0 for c in model.coef) and model.c_draft >= 0


def test_a_steady_workload_keeps_what_the_longer_past_taught():
    """A flooder's same-sized steps for hundreds of steps tell the recent fit nothing about
    c0 against c_decode; the one-row step (the derived ITL target's base) must still be
    predicted near what it cost before the flood, not with the flood's whole step in c0."""
    import numpy as np

    def cost(shape):
        return C0 + C_DEC * shape.decode_rows + C_PRE * shape.prefill_tokens + 0.0003 * shape.draft_tokens

    for seed in range(5):
        rng = np.random.default_rng(seed)
        model = StepCostModel()
        for i in range(100):  # a quiet tenant's one-row steps (and a few prompts)
            shape = StepShape(1, 4 if i % 7 == 0 else 0, 1)
            model.observe(shape, cost(shape) * rng.lognormal(0, 0.15))
        for i in range(300):  # a steady drafting flood: 11-13 rows, drafts with them
            rows = int(rng.integers(11, 14))
            shape = StepShape(rows, 0, 1 + (i % 5 == 0), 2 * rows + int(rng.integers(-3, 4)))
            model.observe(shape, cost(shape) * rng.lognormal(0, 0.3))
        one_row = model.predict(StepShape(1, 0, 1)) / cost(StepShape(1, 0, 1))
        flood = model.predict(StepShape(12, 0, 1, 24)) / cost(StepShape(12, 0, 1, 24))
        assert 0.5 < one_row < 1.4 and 0.85 < flood < 1.15, (seed, one_row, flood, model.coef)


def test_never_plans_past_the_budget_and_fair_share_holds():
    target_ms = 40.0  # the step while keys compete: CONTENTION_SHARE of the ITL target
    sched = make_scheduler(target_itl_ms=target_ms / CONTENTION_SHARE)
    flood = [make_seq(f"f{i}", "flood") for i in range(64)]
    for seq in flood:
        sched.add(seq)
    for _ in range(WARM_STEPS + 12):  # the flood alone
        plan = step(sched)
    assert sched.budget.model.warm
    rows = sum(1 for s in plan.scheduled if not s.is_prefill)
    # alone it keeps the rows its throughput needs (>= ALONE_EFFICIENCY of all 64 at once)
    alone = rows / fake_seconds(plan)
    everything = 64 / (C0 + C_DEC * 64)
    assert rows < 64 and alone >= (ALONE_EFFICIENCY - 0.005) * everything, (rows, alone / everything)

    quiet = make_seq("q", "quiet", prompt_len=40)
    sched.add(quiet)
    ran: dict[str, int] = {}
    over = []
    for i in range(60):
        plan = step(sched)
        seconds = fake_seconds(plan)
        if i >= 8:  # the model has seen capped steps by now
            over.append(seconds * 1000 / target_ms)
            assert quiet.seq_id in [s.seq_id for s in plan.scheduled]  # the small key always runs
        for s in plan.scheduled:
            ran[s.request_id] = ran.get(s.request_id, 0) + 1
    assert max(over) <= 1.05, over
    assert quiet.num_output_tokens >= 50
    sched.finish(quiet)
    plan = step(sched)  # the quiet key had work a moment ago: it may come back, rows stay few
    assert sum(1 for s in plan.scheduled if not s.is_prefill) < rows
    for _ in range(int(RECENT_S / 0.04) + 2):  # beyond RECENT_S alone again: as many rows as before
        plan = step(sched)
    assert sum(1 for s in plan.scheduled if not s.is_prefill) == rows
    flood_runs = [ran.get(f"f{i}", 0) for i in range(64)]
    assert min(flood_runs) >= 0.5 * max(flood_runs)  # the flooder's surplus rotates evenly


def _warm_with_prompts(sched: Scheduler, key: str = "a", rows: int = 4) -> None:
    """``rows`` decodes of ``key`` and a few prompts of varied length, so the cost model
    has learnt decode rows and prompt tokens alike."""
    for i in range(rows):
        sched.add(make_seq(f"d{i}", key))
    for _ in range(WARM_STEPS + 4):
        step(sched)
    for i in range(4):
        sched.add(make_seq(f"p{i}", key, prompt_len=100 + 50 * i, max_tokens=2))
        step(sched)


def test_prompt_chunks_beside_decodes_shrink_to_the_budget():
    sched = make_scheduler(target_itl_ms=0.030 / CONTENTION_SHARE * 1000)
    _warm_with_prompts(sched)
    long = make_seq("long", "b", prompt_len=600)  # another key's prompt beside a's decodes
    sched.add(long)
    chunks = []
    while long.num_output_tokens == 0:
        plan = step(sched)
        chunks += [s.num_new_tokens for s in plan.scheduled if s.seq_id == long.seq_id]
        assert fake_seconds(plan) <= 0.030 * 1.05  # keys compete: CONTENTION_SHARE of the target
    assert len(chunks) > 1 and max(chunks) < 600 and sum(chunks) == 600


def test_a_key_alone_keeps_its_decodes_within_the_itl_target():
    """The ITL target holds for a key alone too (its own streams would freeze for the
    whole prompt otherwise): every decode runs each step, the prompt takes what is left of
    the target, and a prompt with no decode beside it takes the whole token budget."""
    sched = make_scheduler(target_itl_ms=30.0)
    _warm_with_prompts(sched)
    for _ in range(int(RECENT_S / 0.03) + 2):  # only key a seen recently
        step(sched)
    long = make_seq("long", "a", prompt_len=600)
    sched.add(long)
    chunks = []
    while long.num_output_tokens == 0:
        plan = step(sched)
        chunks += [s.num_new_tokens for s in plan.scheduled if s.seq_id == long.seq_id]
        assert sum(1 for s in plan.scheduled if not s.is_prefill) == 4  # every decode, every step
        assert fake_seconds(plan) <= 0.030 * 1.05
    assert len(chunks) > 1 and sum(chunks) == 600
    assert max(chunks) > 0.9 * (0.030 - C0 - C_AD - 5 * C_DEC) / C_PRE  # chunks fill the target
    lone = make_scheduler(target_itl_ms=30.0)
    _warm_with_prompts(lone)
    for seq in [*lone.running, *lone.waiting]:
        lone.finish(seq)
    alone = make_seq("alone", "a", prompt_len=600)
    lone.add(alone)
    plan = step(lone)
    assert [s.num_new_tokens for s in plan.scheduled] == [600]  # no decode: the whole budget


def test_the_itl_cap_never_starves_a_waiting_prompt():
    """Decodes that alone cost more than the target still leave every step a minimum chunk
    to the prompts: a waiting prompt starts at once and its prefill ends within a bounded
    number of steps (its tokens and those of the prompts ahead, MIN_CHUNK_TOKENS a step)."""
    sched = make_scheduler(target_itl_ms=20.0)
    _warm_with_prompts(sched, rows=40)  # 40 rows: 0.01 + 40 * 0.002 = 90 ms > the 20 ms target
    for _ in range(int(RECENT_S / 0.09) + 2):
        step(sched)
    prompts = [make_seq(f"w{i}", "a", prompt_len=300) for i in range(3)]
    for seq in prompts:
        sched.add(seq)
    bound = -(-sum(s.num_tokens for s in prompts) // MIN_CHUNK_TOKENS)
    for n in range(1, bound + 1):
        left = sum(s.num_tokens - s.num_computed_tokens for s in prompts if not s.num_output_tokens)
        plan = step(sched)
        assert sum(1 for s in plan.scheduled if not s.is_prefill) >= 40  # decodes keep going
        progress = sum(s.num_new_tokens for s in plan.scheduled if s.is_prefill)
        assert progress >= min(MIN_CHUNK_TOKENS, left), (n, progress, left)
        if all(s.num_output_tokens for s in prompts):
            break
    assert all(s.num_output_tokens for s in prompts), f"prompts not done after {n} steps"
    assert prompts[0].num_output_tokens > 0


def test_a_cold_engine_bounds_prompts_beside_decodes():
    """Before the cost model has seen WARM_STEPS steps it cannot price a prompt chunk: a prompt
    arriving beside running decodes then goes in chunks of COLD_CHUNK_TOKENS (a new engine's
    first steps took it whole), and a prompt with no decode beside it still goes whole."""
    sched = make_scheduler()
    first = make_seq("first", "a", prompt_len=1500)
    sched.add(first)
    plan = step(sched)
    assert [s.num_new_tokens for s in plan.scheduled] == [1500]  # alone: the whole budget
    long = make_seq("long", "a", prompt_len=1500)
    sched.add(long)
    chunks = []
    while long.num_output_tokens == 0:
        plan = step(sched)
        chunks += [s.num_new_tokens for s in plan.scheduled if s.seq_id == long.seq_id]
        assert sum(1 for s in plan.scheduled if not s.is_prefill) == 1  # the decode runs every step
    assert sum(chunks) == 1500 and max(chunks) <= COLD_CHUNK_TOKENS
    assert chunks[0] == COLD_CHUNK_TOKENS


def test_budget_off_keeps_token_budget():
    sched = make_scheduler(enable_step_budget=False)
    assert sched.budget is None
    for i in range(64):
        sched.add(make_seq(f"f{i}", "flood"))
    sched.add(make_seq("q", "quiet"))
    for _ in range(WARM_STEPS + 4):
        plan = step(sched)
    assert len(plan.scheduled) == 65


def test_fair_rows_water_fills_by_weight_and_rotates():
    seqs = [make_seq(f"a{i}", "a") for i in range(10)] + [make_seq("b0", "b")]
    got = fair_rows(seqs, 4, set())
    assert [s.request_id for s in got].count("b0") == 1 and len(got) == 4
    # fewer rows than keys, a waiting prompt's share besides: every key with decodes still
    # runs one row (an empty step would never teach the cost model otherwise: a livelock)
    assert sorted(s.fairness_key for s in fair_rows(seqs, 1, {"c"})) == ["a", "b"]
    got = fair_rows(seqs, 4, {"c"})  # a waiting prompt of key c holds one share
    assert len(got) == 3 and "b0" in [s.request_id for s in got]
    for s in got:
        s.budget_ran = 1
    again = fair_rows(seqs, 4, set())
    assert {s.request_id for s in again if s.fairness_key == "a"}.isdisjoint(
        {s.request_id for s in got if s.fairness_key == "a"})


def test_a_sprayers_adapters_cannot_stretch_a_neighbours_steps():
    """The cost model may put a step's cost on adapters rather than rows (one tenant's rows
    each on their own adapter grow together): the rows are capped all the same, the target
    is that of one row with one adapter, and the neighbour's row runs."""
    model = StepCostModel()
    shapes = [StepShape(d, p, a) for d in (1, 5, 20) for p in (0, 100) for a in (0, 2, 8)]
    for shape in shapes * 3:  # nothing per row, 3 ms per adapter
        model.observe(shape, 0.010 + 0.0005 * shape.prefill_tokens + 0.003 * shape.adapters)
    assert model.warm and model.coef[1] < 1e-4
    budget = StepBudget(None, model)
    spray = [make_seq(f"s{i}", "sprayer") for i in range(12)]
    for i, seq in enumerate(spray):
        seq.lora_key = f"spray-{i % 10}"
    neighbour = make_seq("n", "neighbour")
    neighbour.lora_key = "mine"
    limits = budget.plan([*spray, neighbour], set(), adapters=11)
    target = CONTENTION_SHARE * budget.target(1)  # 19.5 ms, not the 11-adapter step's
    assert abs(target - CONTENTION_SHARE * DEFAULT_MULTIPLE * 0.013) < 1e-4
    assert limits.runs(neighbour) and limits.decode is not None
    rows = len(limits.decode)
    assert 2 <= rows < 13
    assert 0.010 + rows * 0.003 <= target * 1.05  # the step, its rows' adapters counted


@pytest.mark.parametrize("tenant_itl", [None, 10_000.0])
def test_derived_target_alone_bounds_a_chunk_to_a_multiple_of_the_decode_step(tenant_itl):
    """Derived target, one key alone with 40 decodes (a decode-only step far above 3x the
    one-row step), the engine reporting ALONE_MULTIPLE x the step of its decodes as the target
    for the ITL-miss count. Where the key's quota sets its own ITL objective (even a lax one), a
    long prompt's chunks make a step at most that; without one, the prompt runs whole (its
    first token in one step, as vLLM's): the decodes' long lives absorb it within their TPOT."""
    sched = make_scheduler()
    _warm_with_prompts(sched, rows=40)
    if tenant_itl is not None:
        sched.budget.objectives.set("a", None, tenant_itl)
    for _ in range(int(RECENT_S / 0.09) + 2):
        step(sched)
    long = make_seq("long", "a", prompt_len=1500)
    sched.add(long)
    decode_only = C0 + 40 * C_DEC
    chunks = []
    while long.num_output_tokens == 0:
        plan = step(sched)
        chunks += [s.num_new_tokens for s in plan.scheduled if s.seq_id == long.seq_id]
        if tenant_itl is not None:
            assert fake_seconds(plan) <= ALONE_MULTIPLE * (decode_only + C_DEC) * 1.05
    if tenant_itl is None:
        assert chunks == [1500]
    else:
        assert len(chunks) > 1 and max(chunks) > (ALONE_MULTIPLE - 1.5) * decode_only / C_PRE
    assert abs(sched.itl_target() - ALONE_MULTIPLE * decode_only) < 0.1 * decode_only
