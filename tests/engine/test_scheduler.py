"""Continuous-batching scheduler and KV block pool, with no model at all."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch
from support import scheduler_harness as harness

from loramux.engine.block_manager import BlockPool, KVCacheManager, OutOfBlocksError
from loramux.engine.config import SchedulerConfig
from loramux.engine.sampling_params import SamplingParams
from loramux.engine.scheduler import Scheduler
from loramux.engine.sequence import Sequence, SequenceStatus
from loramux.engine.step_data import ModelOutput, SchedulerOutput


def make_scheduler(
    num_blocks: int = 64,
    block_size: int = 4,
    max_model_len: int = 64,
    adapters=None,
    **config,
) -> Scheduler:
    return harness.make_scheduler(SchedulerConfig(**config), KVCacheManager(num_blocks, block_size),
                                  max_model_len, adapters)


def make_seq(name: str, prompt_len: int = 4, max_tokens: int = 4, lora: str | None = None) -> Sequence:
    return Sequence(name, 0, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens), lora)


def run_step(sched: Scheduler) -> SchedulerOutput:
    """One step through the scheduler's plain-data output: the "model" picks 101, 102, ...
    for each sequence's outputs, ``update_from_output`` applies it (finish at max_tokens)."""
    plan, _ = harness.step(sched)
    check_invariants(sched)
    return plan


def check_invariants(sched: Scheduler) -> None:
    """Every block is owned by exactly one live sequence or free."""
    owned = [b for s in sched.running for b in s.block_table]
    owned += [b for s in sched.waiting for b in s.block_table]
    assert len(owned) == len(set(owned))
    assert len(owned) + sched.kv.num_free_blocks == sched.kv.pool.num_blocks
    for s in sched.running:
        assert s.status is SequenceStatus.RUNNING
        assert len(s.block_table) == sched.kv.blocks_for(s.num_computed_tokens)
    for s in sched.waiting:
        assert s.block_table == [] and s.num_computed_tokens == 0


def names(plan: SchedulerOutput) -> dict[str, int]:
    return {s.request_id: s.num_new_tokens for s in plan.scheduled}


# ------------------------------------------------------------------------ continuous batching


def test_requests_join_and_leave_between_steps():
    sched = make_scheduler()
    a = make_seq("a", prompt_len=5, max_tokens=3)
    sched.add(a)
    assert names(run_step(sched)) == {"a": 5}  # prefill
    b = make_seq("b", prompt_len=3, max_tokens=2)
    sched.add(b)
    plan = run_step(sched)
    assert names(plan) == {"a": 1, "b": 3}  # a decodes while b prefills
    assert [s.is_prefill for s in plan.scheduled] == [False, True]
    c = make_seq("c", prompt_len=2, max_tokens=1)
    sched.add(c)
    assert names(run_step(sched)) == {"a": 1, "b": 1, "c": 2}
    # a (3 tokens), b (2 tokens) and c (1 token) are all finished now
    assert a.is_finished and b.is_finished and c.is_finished
    assert a.output_token_ids == [101, 102, 103]
    assert sched.num_unfinished == 0
    assert sched.kv.num_free_blocks == 64
    assert run_step(sched).is_empty


def test_max_num_seqs_bounds_the_batch():
    sched = make_scheduler(max_num_seqs=2)
    seqs = [make_seq(f"s{i}", max_tokens=2) for i in range(3)]
    for s in seqs:
        sched.add(s)
    assert names(run_step(sched)) == {"s0": 4, "s1": 4}
    assert list(sched.waiting) == [seqs[2]]
    assert names(run_step(sched)) == {"s0": 1, "s1": 1}  # both finish here
    assert names(run_step(sched)) == {"s2": 4}


def test_max_num_batched_tokens_bounds_the_step():
    sched = make_scheduler(max_num_batched_tokens=10, enable_chunked_prefill=False)
    for i in range(3):
        sched.add(make_seq(f"s{i}", prompt_len=6, max_tokens=5))
    seen = []
    while sched.num_unfinished:
        plan = run_step(sched)
        assert plan.num_batched_tokens <= 10
        seen.append(names(plan))
    assert seen[0] == {"s0": 6}  # 6 + 6 > 10
    assert seen[1] == {"s0": 1, "s1": 6}  # 7 <= 10, one more prompt would make 13
    assert seen[2] == {"s0": 1, "s1": 1, "s2": 6}  # 8 <= 10


def test_prompt_longer_than_max_model_len_is_refused():
    sched = make_scheduler(max_model_len=16)
    with pytest.raises(ValueError, match="max_model_len"):
        sched.add(make_seq("long", prompt_len=17))
    sched.add(make_seq("ok", prompt_len=16))


def test_prompt_larger_than_the_kv_cache_is_refused():
    sched = make_scheduler(num_blocks=2, block_size=4)
    with pytest.raises(ValueError, match="KV cache"):
        sched.add(make_seq("big", prompt_len=9, max_tokens=1))  # 9 tokens need 3 blocks
    sched.add(make_seq("fits", prompt_len=8, max_tokens=1))  # only the prompt is computed
    assert names(run_step(sched)) == {"fits": 8}


def test_sequence_that_would_outgrow_the_kv_cache_is_refused():
    # alone it would need 4 blocks at the end: preempting itself forever is no way out
    sched = make_scheduler(num_blocks=3, block_size=4, max_model_len=64)
    with pytest.raises(ValueError, match="KV cache"):
        sched.add(make_seq("grows", prompt_len=4, max_tokens=10))  # 13 computed tokens
    sched.add(make_seq("fits", prompt_len=4, max_tokens=9))  # 12 computed tokens: 3 blocks
    while sched.num_unfinished:
        run_step(sched)
    # without max_tokens a sequence may grow to max_model_len
    with pytest.raises(ValueError, match="KV cache"):
        sched.add(Sequence("open", 0, [1, 2], SamplingParams(max_tokens=None)))
    small = make_scheduler(num_blocks=3, block_size=4, max_model_len=13)
    small.add(Sequence("open", 0, [1, 2], SamplingParams(max_tokens=None)))


def test_prompt_larger_than_the_token_budget_is_refused():
    # it could never be scheduled (no chunked prefill): refuse instead of waiting forever
    sched = make_scheduler(max_model_len=64, max_num_batched_tokens=8, enable_chunked_prefill=False)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        sched.add(make_seq("big", prompt_len=9))
    # with chunked prefill it runs over several steps
    chunked = make_scheduler(max_model_len=64, max_num_batched_tokens=8)
    chunked.add(make_seq("big", prompt_len=20, max_tokens=2))
    assert [names(run_step(chunked)) for _ in range(4)] == [
        {"big": 8}, {"big": 8}, {"big": 4}, {"big": 1}
    ]


# ------------------------------------------------------------------------ preemption


def test_newest_sequence_is_preempted_when_blocks_run_out(caplog):
    sched = make_scheduler(num_blocks=3, block_size=4)
    a, b, c = (make_seq(n, prompt_len=4, max_tokens=6) for n in "abc")
    for s in (a, b, c):
        sched.add(s)
    assert names(run_step(sched)) == {"a": 4, "b": 4, "c": 4}
    assert sched.kv.num_free_blocks == 0
    with caplog.at_level(logging.WARNING, logger="loramux.engine.scheduler"):
        plan = run_step(sched)
    # a needs a 2nd block: c (newest) is preempted; then b needs one and only itself is left
    assert plan.preempted == [c.seq_id, b.seq_id]
    assert names(plan) == {"a": 1}
    assert list(sched.waiting) == [b, c]  # the older preempted sequence first
    assert sched.num_preemptions == 2 and b.num_preemptions == 1 and c.num_preemptions == 1
    msgs = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(msgs) == 2
    assert all("preempted by RECOMPUTE mode" in m and "not enough KV cache space" in m for m in msgs)
    assert "total_num_cumulative_preemption=2" in msgs[-1]
    # nothing is admitted in a step that preempted
    assert all(s.seq_id == a.seq_id for s in plan.scheduled)


def test_preempted_sequence_is_recomputed_with_its_output():
    sched = make_scheduler(num_blocks=3, block_size=4)
    a = make_seq("a", prompt_len=4, max_tokens=5)
    b = make_seq("b", prompt_len=4, max_tokens=5)
    sched.add(a)
    sched.add(b)
    run_step(sched)  # both prefill, 1 token each
    assert names(run_step(sched)) == {"a": 1}  # b preempted
    assert b.status is SequenceStatus.WAITING and b.output_token_ids == [101]
    steps = 0
    while not b.block_table and sched.num_unfinished:
        plan = run_step(sched)
        steps += 1
        if "b" in names(plan):
            # recompute: prompt + the token generated before preemption, in one prefill
            assert names(plan)["b"] == 5
            assert [s.is_prefill for s in plan.scheduled if s.seq_id == b.seq_id] == [True]
            break
    else:
        pytest.fail("b was never rescheduled")
    while sched.num_unfinished:
        run_step(sched)
    assert a.output_token_ids == [101, 102, 103, 104, 105]
    assert b.output_token_ids == [101, 102, 103, 104, 105]
    assert sched.kv.num_free_blocks == 3


def test_preempted_sequence_longer_than_the_token_budget_is_recomputed_alone():
    # without chunked prefill (with it, the recompute is chunked like any prompt)
    sched = make_scheduler(
        num_blocks=5, block_size=4, max_model_len=32, max_num_batched_tokens=8, enable_chunked_prefill=False
    )
    a = make_seq("a", prompt_len=6, max_tokens=12)
    b = make_seq("b", prompt_len=2, max_tokens=12)
    sched.add(a)
    sched.add(b)
    recompute = None
    for _ in range(100):
        if not sched.num_unfinished:
            break
        plan = run_step(sched)
        if b.num_preemptions and names(plan).get("b", 0) > 1:
            recompute = plan
    assert b.num_preemptions == 1
    assert recompute is not None and names(recompute) == {"b": 9}  # 2 + 7 tokens, alone
    assert a.is_finished and b.is_finished and b.num_output_tokens == 12


def test_heavy_load_finishes_everything_with_consistent_blocks():
    sched = make_scheduler(num_blocks=10, block_size=4, max_num_seqs=6)
    seqs = [make_seq(f"s{i}", prompt_len=3 + i % 5, max_tokens=6 + i % 7) for i in range(12)]
    for s in seqs:
        sched.add(s)
    for _ in range(500):
        if not sched.num_unfinished:
            break
        run_step(sched)
    assert all(s.is_finished for s in seqs)
    assert all(s.num_output_tokens == s.params.max_tokens for s in seqs)
    assert sched.num_preemptions > 0
    assert sched.kv.num_free_blocks == 10


def test_finish_of_a_waiting_sequence_removes_it():
    sched = make_scheduler(max_num_seqs=1)
    a, b = make_seq("a"), make_seq("b")
    sched.add(a)
    sched.add(b)
    run_step(sched)
    sched.finish(b)  # abort while waiting
    sched.finish(a)  # abort while running
    assert sched.num_unfinished == 0
    assert sched.kv.num_free_blocks == 64
    assert a.is_finished and b.is_finished


# ------------------------------------------------------------------------ adapters


class FakeGate:
    """Adapter slots: ``max_loras`` of them (LRU); ``cold`` adapters load for ``load_steps``
    asks. Records every ``acquire`` and every ``prefetch``."""

    def __init__(self, max_loras: int, cold: dict[str, int] | None = None) -> None:
        self.max_loras = max_loras
        self.cold = dict(cold or {})
        self.resident: list[str] = []  # oldest first
        self.calls: list[tuple[str, frozenset]] = []
        self.prefetched: list[str] = []
        self.evicted: list[str] = []

    def acquire(self, lora_key: str, in_use: set[str]) -> bool:
        self.calls.append((lora_key, frozenset(in_use)))
        if lora_key in self.resident:
            return True
        if self.cold.get(lora_key, 0) > 0:
            self.cold[lora_key] -= 1
            return False
        if len(self.resident) >= self.max_loras:
            idle = [k for k in self.resident if k not in in_use]
            if not idle:
                return False
            self.resident.remove(idle[0])
            self.evicted.append(idle[0])
        self.resident.append(lora_key)
        return True

    def is_resident(self, lora_key: str) -> bool:
        return lora_key in self.resident

    def prefetch(self, lora_keys: list[str]) -> None:
        self.prefetched.extend(lora_keys)

    def note_running(self, lora_keys: set[str]) -> None:
        self.running = set(lora_keys)


def adapters_of(plan: SchedulerOutput) -> set[str]:
    return {s.lora_key for s in plan.scheduled if s.lora_key is not None}


def test_without_a_gate_adapter_requests_wait():
    sched = make_scheduler()
    sched.add(make_seq("x", lora="a"))
    sched.add(make_seq("y"))
    assert names(run_step(sched)) == {"y": 4}


def test_gate_limits_distinct_adapters_per_step():
    gate = FakeGate(max_loras=2)
    sched = make_scheduler(adapters=gate)
    seqs = [make_seq(f"s{i}", max_tokens=3, lora=k) for i, k in enumerate("abcab")] + [make_seq("base")]
    for s in seqs:
        sched.add(s)
    plan = run_step(sched)
    # a, b admitted (and their second requests), c waits, the base model request runs
    assert names(plan) == {"s0": 4, "s1": 4, "s3": 4, "s4": 4, "base": 4}
    assert adapters_of(plan) == {"a", "b"}
    while sched.num_unfinished:
        plan = run_step(sched)
        assert len(adapters_of(plan)) <= 2
    assert seqs[2].output_token_ids == [101, 102, 103]
    # the gate is never asked for an adapter already in use
    assert all(key not in in_use for key, in_use in gate.calls)


def test_a_cold_adapter_does_not_block_others():
    gate = FakeGate(max_loras=4, cold={"cold": 3})
    sched = make_scheduler(adapters=gate)
    cold = make_seq("cold", lora="cold", max_tokens=2)
    sched.add(cold)
    sched.add(make_seq("warm", lora="warm", max_tokens=2))
    sched.add(make_seq("base", max_tokens=2))
    assert names(run_step(sched)) == {"warm": 4, "base": 4}
    assert cold.skipped_steps == 1
    run_step(sched)
    run_step(sched)
    plan = run_step(sched)  # loaded after 3 asks
    assert names(plan) == {"cold": 4}
    assert cold.skipped_steps == 0


def test_aging_bounds_the_wait_of_a_starved_adapter():
    # one slot; a steady stream of requests for adapter "a" would keep it busy forever
    gate = FakeGate(max_loras=1)
    sched = make_scheduler(num_blocks=256, adapters=gate, starvation_steps=3)
    b = make_seq("b", lora="b", max_tokens=2)
    admitted_at = None
    for step in range(40):
        sched.add(make_seq(f"a{step}", lora="a", max_tokens=4))
        if step == 1:
            sched.add(b)
        plan = run_step(sched)
        assert len(adapters_of(plan)) <= 1
        if b.seq_id in [s.seq_id for s in plan.scheduled] and admitted_at is None:
            admitted_at = step
    assert admitted_at is not None, "the request for adapter b starved"
    # starvation_steps skipped steps, then the running "a" requests (4 tokens) drain
    assert admitted_at - 1 <= 3 + 4 + 2
    assert b.is_finished


# ------------------------------------------------------------------------ block pool


def test_block_pool_reference_counts():
    pool = BlockPool(4)
    blocks = pool.allocate(2)
    assert pool.num_free == 2
    assert [pool.ref_count(b) for b in blocks] == [1, 1]
    pool.share(blocks[0])
    assert pool.ref_count(blocks[0]) == 2
    pool.release(blocks[0])
    assert pool.ref_count(blocks[0]) == 1 and pool.num_free == 2  # still held once
    pool.release(blocks[0])
    assert pool.ref_count(blocks[0]) == 0 and pool.num_free == 3
    with pytest.raises(ValueError, match="released more often"):
        pool.release(blocks[0])
    with pytest.raises(ValueError, match="not allocated"):
        pool.share(blocks[0])
    with pytest.raises(OutOfBlocksError):
        pool.allocate(4)
    assert pool.num_free == 3  # a failed allocation takes nothing
    again = pool.allocate(3)
    assert sorted(again + [blocks[1]]) == [0, 1, 2, 3]
    with pytest.raises(ValueError):
        BlockPool(0)


def test_kv_cache_manager_grows_block_tables():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    seq = make_seq("s", prompt_len=5)
    assert kv.num_new_blocks(seq, 5) == 2
    kv.allocate(seq, 5)
    seq.num_computed_tokens = 5
    assert len(seq.block_table) == 2
    assert kv.num_new_blocks(seq, 3) == 0  # 8 tokens fit in 2 blocks
    assert kv.num_new_blocks(seq, 4) == 1
    kv.allocate(seq, 4)
    assert len(seq.block_table) == 3 and kv.num_free_blocks == 5
    assert kv.usage == pytest.approx(3 / 8)
    kv.free(seq)
    assert seq.block_table == [] and seq.num_computed_tokens == 0
    assert kv.num_free_blocks == 8 and kv.usage == 0.0


# ------------------------------------------------------------------------ the step as plain data


def _no_live_objects(value) -> bool:
    """True when ``value`` holds only ids, numbers, strings and lists/tuples/dicts of them."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return True
    if isinstance(value, (list, tuple)):
        return all(_no_live_objects(v) for v in value)
    if isinstance(value, dict):
        return all(_no_live_objects(k) and _no_live_objects(v) for k, v in value.items())
    if dataclasses.is_dataclass(value):
        return all(_no_live_objects(getattr(value, f.name)) for f in dataclasses.fields(value))
    return False


def test_the_plan_is_plain_data_the_runner_can_build_tensors_from():
    sched = make_scheduler(block_size=4, adapters=FakeGate(2))
    a = make_seq("a", prompt_len=6, max_tokens=3, lora="x")
    b = make_seq("b", prompt_len=3, max_tokens=3)
    sched.add(a)
    run_step(sched)  # a prefills
    sched.add(b)
    plan = sched.schedule()
    assert _no_live_objects(plan) and not any(isinstance(r, Sequence) for r in plan.scheduled)
    ra, rb = plan.scheduled
    assert (ra.request_id, ra.seq_id, ra.num_new_tokens, ra.num_computed_tokens, ra.is_prefill,
            ra.lora_key) == ("a", a.seq_id, 1, 6, False, "x")
    assert ra.token_ids == [101] and ra.block_ids == a.block_table and len(ra.block_ids) == 2
    assert (rb.token_ids, rb.num_computed_tokens, rb.is_prefill, rb.lora_key) == ([1, 2, 3], 0, True, None)
    assert (plan.num_batched_tokens, plan.num_prefill_tokens, plan.num_decode_rows, plan.num_adapters) == (4, 3, 1, 1)
    a.block_table.append(63)  # the plan is a copy: what happens to the sequences later does not change it
    assert len(ra.block_ids) == 2


def test_forks_share_the_prompt_and_sample_from_its_row_once_it_is_computed():
    sched = make_scheduler(block_size=4, max_num_batched_tokens=6)
    params = SamplingParams(n=3, max_tokens=2, temperature=1.0)
    first, *siblings = (Sequence("r", i, list(range(1, 10)), params) for i in range(3))
    sched.add(first)
    first.pending_forks = siblings  # as LLMEngine.add_request: one prefill, then forks
    plan, outcome = harness.step(sched)  # 6 of 9 prompt tokens: nothing sampled, no fork yet
    assert names(plan) == {"r": 6} and outcome.advanced == [] and outcome.num_forks == 0
    assert first.pending_forks == siblings and sched.running == [first]
    plan, outcome = harness.step(sched)  # the last 3: the siblings fork and sample too
    assert [r.num_new_tokens for r in plan.scheduled] == [3]
    assert outcome.advanced == ["r"] and outcome.num_forks == 2 and first.pending_forks == []
    assert [s.output_token_ids for s in (first, *siblings)] == [[101]] * 3
    assert all(s.block_table == first.block_table for s in siblings)
    assert all(sched.kv.pool.ref_count(b) == 3 for b in first.block_table)
    plan, outcome = harness.step(sched)  # three decode rows; the shared tail is copied on write
    assert [r.seq_id for r in plan.scheduled] == [s.seq_id for s in (first, *siblings)]
    assert len(plan.copies) == 2 and all(s.is_finished for s in (first, *siblings))
    assert sched.kv.num_free_blocks == 64 and not sched.seqs


def test_a_row_failing_in_the_sampler_fails_only_its_request():
    sched = make_scheduler()
    good, bad = make_seq("good", max_tokens=2), make_seq("bad", max_tokens=2)
    sched.add(good)
    sched.add(bad)
    outputs = harness.make_output_processor(64)
    inner = outputs.sampler

    class Sampler:
        vocab_size = harness.VOCAB

        def __call__(self, logits, seqs):
            if any(s.request_id == "bad" for s in seqs):
                raise ValueError("a broken logits processor")
            return inner(logits, seqs)

    outputs.sampler = Sampler()
    plan = sched.schedule()
    outcome = harness.sample(outputs, sched, plan, harness.model_output(sched, plan))
    assert names(plan) == {"good": 4, "bad": 4}
    assert outcome.advanced == ["good"] and list(outcome.failed) == ["bad"]
    assert isinstance(outcome.failed["bad"], ValueError)
    assert good.output_token_ids == [101] and bad.output_token_ids == []
    sched.finish(bad)  # the engine ends a failed request
    run_step(sched)
    assert good.is_finished and good.output_token_ids == [101, 102]


def test_a_non_finite_row_fails_its_request_and_marks_its_adapter_broken():
    from loramux.engine.errors import AdapterNumericsError

    broken = harness.BrokenLog()
    sched = harness.Scheduler(SchedulerConfig(), KVCacheManager(64, 4), 64, FakeGate(4))
    outputs = harness.make_output_processor(64, broken=broken)
    seqs = {name: make_seq(name, lora=lora) for name, lora in
            (("neighbour", None), ("poisoned", "bad"), ("base-nan", None), ("other", "fine"))}
    for s in seqs.values():
        sched.add(s)
    plan = sched.schedule()
    out = harness.model_output(sched, plan)
    rows = {r.request_id: i for i, r in enumerate(plan.scheduled)}
    out.logits[rows["poisoned"], 7] = float("inf")
    out.logits[rows["base-nan"], 3] = float("nan")
    out.logits[rows["other"], :] = 3e36  # finite but the row's sum overflows: still fine
    outcome = harness.sample(outputs, sched, plan, out)
    assert set(outcome.failed) == {"poisoned", "base-nan"}
    assert all(isinstance(e, AdapterNumericsError) for e in outcome.failed.values())
    assert outcome.failed["poisoned"].adapter == "bad" and outcome.failed["base-nan"].adapter is None
    assert [key for key, _ in broken.marked] == ["bad"]
    assert outcome.advanced == ["neighbour", "other"]
    assert seqs["neighbour"].output_token_ids == [101] and seqs["poisoned"].num_computed_tokens == 0


def test_a_batch_level_error_fails_every_request_of_the_plan():
    sched = make_scheduler()
    for name in "ab":
        sched.add(make_seq(name))
    plan = sched.schedule()
    outputs = harness.make_output_processor(64)
    outcome = harness.sample(outputs, sched, plan, ModelOutput(plan.scheduled, error=MemoryError("oom")))
    assert set(outcome.failed) == {"a", "b"} and outcome.advanced == []
    assert all(s.num_computed_tokens == 0 for s in sched.running)  # nothing was computed


def test_prompt_logprobs_of_a_long_prompt_are_read_in_chunks_and_match_a_full_softmax():
    from loramux.engine.postprocess import LOGPROB_ROWS

    prompt_len = LOGPROB_ROWS * 2 + 5
    sched = make_scheduler(num_blocks=128, max_model_len=512)
    seq = Sequence("p", 0, [(7 * i) % harness.VOCAB for i in range(prompt_len)],
                   SamplingParams(max_tokens=1, prompt_logprobs=2))
    sched.add(seq)
    plan = sched.schedule()
    (row,) = plan.scheduled
    assert row.num_prompt_logits == prompt_len - 1
    prompt_logits = torch.randn(prompt_len - 1, harness.VOCAB, generator=torch.Generator().manual_seed(0))
    out = harness.model_output(sched, plan)
    out.prompt_logits = {0: prompt_logits}
    outcome = harness.sample(harness.make_output_processor(512), sched, plan, out)
    assert outcome.advanced == ["p"] and seq.is_finished
    lp = torch.log_softmax(prompt_logits, dim=-1)
    assert seq.prompt_logprobs[0] is None and len(seq.prompt_logprobs) == prompt_len
    for pos in (1, LOGPROB_ROWS, LOGPROB_ROWS + 1, prompt_len - 1):  # across chunk edges
        tid = seq.prompt_token_ids[pos]
        entry = seq.prompt_logprobs[pos]
        want = lp[pos - 1, tid].item()
        assert entry[tid].logprob == pytest.approx(want, abs=1e-5)
        assert entry[tid].rank == int((lp[pos - 1] > want).sum()) + 1
        top = lp[pos - 1].topk(2).indices.tolist()
        assert set(top) <= set(entry) and len(entry) <= 3


def test_stop_tokens_and_eos_finish_in_update_from_output_and_free_the_blocks():
    sched = harness.Scheduler(SchedulerConfig(), KVCacheManager(64, 4), 64, None)
    stop = Sequence("stop", 0, [1, 2, 3], SamplingParams(max_tokens=10, stop_token_ids=[102]))
    eos = Sequence("eos", 0, [4, 5], SamplingParams(max_tokens=10))
    for s in (stop, eos):
        sched.add(s)

    def token(sched, seq_id):
        return 0 if sched.seqs[seq_id].request_id == "eos" and sched.seqs[seq_id].num_output_tokens else (
            harness.next_output_token(sched, seq_id))

    harness.step(sched, token, eos={0})
    _, outcome = harness.step(sched, token, eos={0})
    assert outcome.advanced == ["stop", "eos"]
    assert (stop.finish_reason, stop.stop_reason, stop.output_token_ids) == ("stop", 102, [101, 102])
    assert (eos.finish_reason, eos.output_token_ids) == ("stop", [101, 0])
    assert sched.num_unfinished == 0 and sched.kv.num_free_blocks == 64
