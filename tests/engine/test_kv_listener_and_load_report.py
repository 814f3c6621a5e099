"""The engine seams behind the inference-gateway protocol: the block manager's KV-event
listener (keys stored, evicted, cleared; one call per run of new blocks, with their
tokens and parent) and the load reports the async engine publishes without waiting."""

from __future__ import annotations

import asyncio
import time

from support.server import make_engine

from loramux.engine.block_manager import KVCacheManager
from loramux.engine.sampling_params import SamplingParams
from loramux.engine.sequence import Sequence


class Recorder:
    def __init__(self) -> None:
        self.events: list[tuple] = []

    def blocks_stored(self, keys, parent, token_ids, block_size, lora_key) -> None:
        self.events.append(("stored", list(keys), parent, list(token_ids), block_size, lora_key))

    def blocks_removed(self, keys) -> None:
        self.events.append(("removed", list(keys)))

    def all_blocks_cleared(self) -> None:
        self.events.append(("cleared",))


def computed(kv: KVCacheManager, s: Sequence) -> Sequence:
    kv.take_prefix(s, kv.lookup_prefix(s))
    kv.allocate(s, s.num_tokens - s.num_computed_tokens)
    s.num_computed_tokens = s.num_tokens
    kv.register_computed(s)
    return s


def test_listener_hears_stores_evictions_and_clears():
    rec = Recorder()
    listeners = [rec]
    kv = KVCacheManager(6, 4, enable_prefix_caching=True, listeners=listeners)
    assert rec.events == [("cleared",)]  # a new cache is empty
    a = computed(kv, Sequence("a", 0, list(range(1, 10)), SamplingParams(), "t/x@1"))
    kind, keys, parent, tokens, bs, lora = rec.events[1]
    assert (kind, parent, tokens, bs, lora) == ("stored", None, list(range(1, 9)), 4, "t/x@1")
    assert keys == a.block_keys[:2] and set(keys) <= set(kv.pool.cached)
    # a sequence reusing the first block stores only its new block, parented on it
    b = computed(kv, Sequence("b", 0, list(range(1, 5)) + [70, 71, 72, 73, 74],
                              SamplingParams(), "t/x@1"))
    _, keys_b, parent_b, tokens_b, _, _ = rec.events[2]
    assert parent_b == a.block_keys[0] and tokens_b == [70, 71, 72, 73] and keys_b == [b.block_keys[1]]
    kv.free(a)
    kv.free(b)
    before = set(kv.pool.cached)
    kv.pool.allocate(6)  # every block: the cached ones are evicted
    removed = [k for e in rec.events if e[0] == "removed" for k in e[1]]
    assert set(removed) == before and not kv.pool.cached
    # a rebuilt manager over the same listeners (an engine restart) clears again
    KVCacheManager(6, 4, enable_prefix_caching=True, listeners=listeners)
    assert rec.events[-1] == ("cleared",)


def test_no_listener_no_calls_and_no_prefix_cache_no_events():
    rec = Recorder()
    kv = KVCacheManager(8, 4, enable_prefix_caching=False, listeners=[rec])
    computed(kv, Sequence("a", 0, list(range(1, 10)), SamplingParams()))
    assert rec.events == [("cleared",)]


def test_load_reports_are_published_without_waiting(tiny_model_dir):
    eng = make_engine(tiny_model_dir, max_model_len=256, max_num_seqs=4, enable_lora=False)
    rec = Recorder()
    remove = eng.add_kv_listener(rec)
    try:
        assert eng.load_report() is None  # the first call starts the publishing
        deadline = time.monotonic() + 5
        while eng.load_report() is None:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        idle = eng.load_report()
        assert idle.stats.num_running == 0 and idle.running_adapters == {}
        assert idle.num_kv_blocks > 0 and idle.block_size == eng.config.cache.block_size
        assert abs(idle.taken_at - time.time()) < 5

        async def run():
            seen = []
            async for _ in eng.generate("tell me a story " * 10,
                                        SamplingParams(max_tokens=30, ignore_eos=True)):
                seen.append(eng.load_report())
            return seen

        seen = asyncio.run(run())
        assert any(r.stats.num_running == 1 and r.stats.kv_cache_usage > 0 for r in seen)
        assert any(e[0] == "stored" for e in rec.events)  # prefix caching is on by default
        deadline = time.monotonic() + 5
        while eng.load_report().stats.num_running:
            assert time.monotonic() < deadline
            time.sleep(0.01)
    finally:
        remove()
        eng.shutdown()
