"""Prefix cache, LRU reuse and copy-on-write in the block manager and scheduler (no model)."""

from __future__ import annotations

from support import scheduler_harness as harness

from loramux.engine.block_manager import KVCacheManager
from loramux.engine.config import SchedulerConfig
from loramux.engine.sampling_params import SamplingParams
from loramux.engine.sequence import Sequence


def seq(name: str, tokens: list[int], adapter: str | None = None) -> Sequence:
    return Sequence(name, 0, tokens, SamplingParams(max_tokens=4), adapter)


def computed(kv: KVCacheManager, s: Sequence) -> Sequence:
    """Admit ``s`` after its cached prefix and compute its whole prompt."""
    cached = kv.lookup_prefix(s)
    kv.take_prefix(s, cached)
    kv.allocate(s, s.num_tokens - s.num_computed_tokens)
    s.num_computed_tokens = s.num_tokens
    kv.register_computed(s)
    return s


def test_same_prefix_hits_and_the_last_token_is_always_computed():
    kv = KVCacheManager(32, 4, enable_prefix_caching=True)
    a = computed(kv, seq("a", list(range(1, 13))))  # 3 full blocks
    b = seq("b", list(range(1, 13)) + [50, 51])
    hits = kv.lookup_prefix(b)
    assert hits == a.block_table[:3]
    same = seq("same", list(range(1, 13)))  # fully cached: its last block is recomputed
    assert kv.lookup_prefix(same) == a.block_table[:2]
    kv.take_prefix(b, hits)
    # "a" asked for 2 blocks (none cached), "b" for 3 (all cached)
    assert b.num_computed_tokens == 12 and kv.stats.hits == 3 and kv.stats.queries == 5


def test_adapters_and_versions_never_share_blocks():
    kv = KVCacheManager(64, 4, enable_prefix_caching=True)
    tokens = list(range(1, 14))
    computed(kv, seq("base", tokens))
    computed(kv, seq("t0", tokens, "tenant1/sql@v1"))
    assert kv.lookup_prefix(seq("t1", tokens, "tenant2/sql@v1")) == []
    assert kv.lookup_prefix(seq("v2", tokens, "tenant1/sql@v2")) == []
    assert len(kv.lookup_prefix(seq("again", tokens, "tenant1/sql@v1"))) == 3


def test_freed_blocks_stay_cached_and_are_evicted_lru():
    kv = KVCacheManager(6, 4, enable_prefix_caching=True)
    old = computed(kv, seq("old", list(range(1, 10))))  # 3 blocks, 2 full
    new = computed(kv, seq("new", list(range(100, 109))))
    kv.free(old)
    kv.free(new)
    assert kv.num_free_blocks == 6
    assert len(kv.lookup_prefix(seq("x", list(range(1, 10))))) == 2
    kv.pool.allocate(3)  # 2 plain free blocks, then the least recently freed cached one
    assert kv.pool.evictions == 1
    assert len(kv.lookup_prefix(seq("y", list(range(100, 109))))) == 2  # freed last: still there
    assert len(kv.lookup_prefix(seq("z", list(range(1, 10))))) < 2


def test_cached_free_blocks_count_when_a_prefix_is_revived():
    kv = KVCacheManager(4, 4, enable_prefix_caching=True)
    a = computed(kv, seq("a", list(range(1, 10))))  # 3 blocks
    kv.free(a)
    b = seq("b", list(range(1, 9)) + [70, 71, 72, 73, 74, 75, 76, 77, 78])  # 2 cached + 3 new blocks
    cached = kv.lookup_prefix(b)
    assert len(cached) == 2
    assert not kv.can_allocate_with_prefix(b, cached, b.num_tokens - 8)  # 5 blocks > 4
    assert kv.can_allocate_with_prefix(b, cached, 8)


def test_fork_shares_blocks_and_copies_a_partial_block_on_write():
    kv = KVCacheManager(16, 4, enable_prefix_caching=True)
    parent = computed(kv, seq("p", list(range(1, 11))))  # 2 full blocks + 2 tokens
    child = seq("c", list(range(1, 11)))
    kv.fork(parent, child)
    assert child.block_table == parent.block_table
    assert all(kv.pool.ref_count(b) == 2 for b in parent.block_table)
    for s in (parent, child):
        s.append_token(99)
    copies: list[tuple[int, int]] = []
    kv.allocate(child, 1, copies)
    shared_tail = parent.block_table[2]
    assert copies == [(shared_tail, child.block_table[2])] and child.block_table[2] != shared_tail
    assert child.block_table[:2] == parent.block_table[:2]
    copies.clear()
    kv.allocate(parent, 1, copies)  # the parent's tail is its own again: no copy
    assert copies == [] and kv.pool.ref_count(shared_tail) == 1


def test_scheduler_starts_after_the_cached_prefix_and_chunks_the_rest():
    kv = KVCacheManager(64, 4, enable_prefix_caching=True)
    sched = harness.make_scheduler(SchedulerConfig(max_num_batched_tokens=6), kv, 64)
    first = seq("first", list(range(1, 18)))
    sched.add(first)
    chunks = []
    while first.num_computed_tokens < first.num_tokens:
        plan = sched.schedule()
        (s,) = plan.scheduled
        chunks.append(s.num_new_tokens)
        first.num_computed_tokens += s.num_new_tokens
        kv.register_computed(first)
    assert chunks == [6, 6, 5]
    first.append_token(99)
    second = seq("second", list(range(1, 17)) + [40, 41, 42])
    sched.add(second)
    plan = sched.schedule()
    by_id = {s.request_id: s.num_new_tokens for s in plan.scheduled}
    assert by_id == {"first": 1, "second": 3} and second.num_computed_tokens == 16


def test_partial_prefills_holding_every_block_make_room_newest_first():
    kv = KVCacheManager(6, 4)
    sched = harness.make_scheduler(SchedulerConfig(max_num_batched_tokens=8), kv, 64)
    a, b = seq("a", list(range(1, 17))), seq("b", list(range(21, 37)))
    for s in (a, b):  # both 12 of 16 prompt tokens computed: 3 blocks each, none free
        sched.add(s)
        kv.allocate(s, 12)
        s.num_computed_tokens = 12
    sched.waiting.clear()
    sched.running = [a, b]
    for s in (a, b):
        s.status = a.status.RUNNING
    plan = sched.schedule()
    assert {s.request_id: s.num_new_tokens for s in plan.scheduled} == {"a": 4}
    assert plan.preempted == [b.seq_id] and b.num_computed_tokens == 0 and list(sched.waiting) == [b]
