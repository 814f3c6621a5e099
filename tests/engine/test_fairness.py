"""Fair-share admission and preemption (Virtual Token Counter), scheduler only, no model."""

from __future__ import annotations

from test_scheduler import make_scheduler, run_step

from loramux.engine.fairness import DECODE_COST, FifoPolicy, VtcPolicy
from loramux.engine.sampling_params import SamplingParams
from loramux.engine.sequence import Sequence


def seq(name: str, key: str | None, prompt_len: int = 4, max_tokens: int = 4, weight: float = 1.0) -> Sequence:
    return Sequence(name, 0, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens),
                    fairness_key=key, fairness_weight=weight)


def admitted_until(sched, name: str, limit: int = 200) -> int:
    """Steps until sequence ``name`` is first scheduled."""
    for step in range(1, limit + 1):
        plan = run_step(sched)
        if any(s.request_id == name for s in plan.scheduled):
            return step
    raise AssertionError(f"{name} never ran")


def test_quiet_key_is_admitted_before_a_flood_backlog():
    sched = make_scheduler(num_blocks=512, max_num_seqs=4, max_num_batched_tokens=64)
    for i in range(64):
        sched.add(seq(f"flood{i}", "a", max_tokens=8))
    for _ in range(3):
        run_step(sched)
    sched.add(seq("quiet", "b"))
    # the quiet key's counter is lifted to the flood's, then the flood's grows past it
    assert admitted_until(sched, "quiet") <= 9


def test_fcfs_makes_the_quiet_key_wait_for_the_backlog():
    sched = make_scheduler(num_blocks=512, max_num_seqs=4, max_num_batched_tokens=64, fairness_policy="fcfs")
    assert isinstance(sched.policy, FifoPolicy)
    for i in range(64):
        sched.add(seq(f"flood{i}", "a", max_tokens=8))
    for _ in range(3):
        run_step(sched)
    sched.add(seq("quiet", "b"))
    assert admitted_until(sched, "quiet") > 60


def test_a_key_alone_uses_the_whole_batch():
    sched = make_scheduler(num_blocks=512, max_num_seqs=8, max_num_batched_tokens=256)
    for i in range(8):
        sched.add(seq(f"r{i}", "only"))
    plan = run_step(sched)
    assert len(plan.scheduled) == 8


def test_counters_charge_weighted_prefill_and_decode_tokens():
    sched = make_scheduler(num_blocks=64, max_num_batched_tokens=64)
    sched.add(seq("heavy", "a", prompt_len=8, max_tokens=3))
    sched.add(seq("light", "b", prompt_len=8, max_tokens=3, weight=2.0))
    while sched.num_unfinished:
        run_step(sched)
    # 8 prompt tokens (cost 1) + 2 decode steps (cost 2); the third token is sampled at prefill
    c = sched.policy.counters
    assert c["a"] == 8 + 2 * DECODE_COST and c["b"] == c["a"] / 2


def test_new_key_is_lifted_to_the_lowest_active_counter():
    policy = VtcPolicy()
    a1, a2 = seq("a1", "a"), seq("a2", "a")
    policy.on_add(a1)
    policy.charge(a1, 100, True)
    policy.on_add(seq("b", "b"))  # idle keys earn no credit: b starts at a's counter
    assert policy.counters["b"] == 100
    policy.on_finish(a1)
    policy.charge(a2, 1, True)  # a2 was never added: charging still counts
    policy.on_add(a2)  # a was idle, lifted to b's 100; it already has 101
    assert policy.counters["a"] == 101


def test_admission_interleaves_keys_by_counter():
    policy = VtcPolicy()
    waiting = [seq(f"a{i}", "a") for i in range(3)] + [seq(f"b{i}", "b") for i in range(3)]
    for s in waiting:
        policy.on_add(s)
    policy.charge(waiting[0], 6, True)
    order = [s.request_id for s in policy.order(waiting)]
    assert order == ["b0", "b1", "a0", "b2", "a1", "a2"]


def preempted_names(policy: str) -> list[str]:
    sched = make_scheduler(num_blocks=6, block_size=4, max_num_batched_tokens=64, fairness_policy=policy)
    for i in range(2):
        sched.add(seq(f"f{i}", "f", prompt_len=4, max_tokens=12))
    run_step(sched)
    run_step(sched)
    sched.add(seq("quiet", "q", prompt_len=4, max_tokens=12))  # newest, lowest counter
    preempted = []
    while sched.num_unfinished:
        preempted += [sched.seqs[i].request_id for i in run_step(sched).preempted]
    assert sched.kv.num_free_blocks == 6
    return preempted


def test_preemption_takes_the_newest_sequence_of_the_key_with_the_highest_counter():
    assert "quiet" in preempted_names("fcfs")  # FIFO preempts the newest
    vtc = preempted_names("vtc")
    assert vtc and "quiet" not in vtc
