"""The engine survives a failing step; a dead loop fails every caller at once and restarts;
a flooding fairness key does not starve a quiet one (tiny model)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from loramux.engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from loramux.engine.sampling_params import SamplingParams


def make_engine(model_dir, blocks: int = 512, **scheduler):
    from loramux.engine.engine import LLMEngine

    return LLMEngine(EngineConfig(
        model=ModelConfig(str(model_dir), dtype="float32", max_model_len=64),
        cache=CacheConfig(block_size=4, num_gpu_blocks_override=blocks),
        scheduler=SchedulerConfig(**scheduler),
    ))


@pytest.fixture
def engine(tiny_model_dir):
    return make_engine(tiny_model_dir, max_num_seqs=64)


GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def run_all(engine) -> dict[str, object]:
    """Step until idle; the last output of every request."""
    last = {}
    for _ in range(500):
        if not engine.has_unfinished_requests():
            return last
        for out in engine.step():
            last[out.request_id] = out
    raise AssertionError("the engine did not finish")


def assert_no_leak(engine) -> None:
    assert engine.kv.num_free_blocks == engine.kv.pool.num_blocks
    assert not engine.scheduler.running and not engine.scheduler.waiting


def test_a_failing_step_fails_its_requests_and_the_engine_goes_on(engine):
    from loramux.engine.engine import EngineStepError

    original = engine.runner.run_batch
    calls = []

    def run_once_broken(batch, copies=()):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("DefaultCPUAllocator: can't allocate memory")
        return original(batch, copies)

    engine.runner.run_batch = run_once_broken
    engine.add_request("a", "hello there", GREEDY)
    engine.add_request("b", "general kenobi", GREEDY)
    failed = {o.request_id: o for o in engine.step()}
    assert set(failed) == {"a", "b"}
    assert all(isinstance(o.extra["error"], EngineStepError) and o.finished for o in failed.values())
    assert "allocate" not in str(failed["a"].extra["error"])  # no internals in the message
    assert_no_leak(engine)
    engine.add_request("c", "hello there", GREEDY)
    out = run_all(engine)["c"]
    assert len(out.outputs[0].token_ids) == 6 and "error" not in out.extra
    assert_no_leak(engine)


def test_a_request_failing_in_sampling_fails_alone(engine):
    engine.add_request("alone", "the quick brown fox", GREEDY)
    reference = run_all(engine)["alone"].outputs[0].token_ids
    original = engine.output_processor.sampler

    def sampler(logits, seqs):
        if any(s.request_id == "bad" for s in seqs):
            raise ValueError("a broken grammar")
        return original(logits, seqs)

    engine.output_processor.sampler = sampler
    engine.add_request("good", "the quick brown fox", GREEDY)
    engine.add_request("bad", "jumps over", GREEDY)
    outs = run_all(engine)
    assert "error" in outs["bad"].extra and outs["bad"].finished
    assert "error" not in outs["good"].extra
    assert outs["good"].outputs[0].token_ids == reference
    assert_no_leak(engine)


@pytest.mark.latency
def test_a_dead_loop_fails_every_caller_at_once_and_restarts(engine):
    from loramux.engine.async_engine import AsyncEngine, EngineDeadError

    eng = AsyncEngine(engine)
    resumed = threading.Event()
    original_reset = engine.reset

    def slow_reset():
        resumed.wait(10)
        original_reset()

    engine.reset = slow_reset
    broken = threading.Event()
    original_schedule = engine.scheduler.schedule

    def schedule():
        if broken.is_set():
            raise RuntimeError("scheduler bug")
        return original_schedule()

    engine.scheduler.schedule = schedule
    long = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)

    async def caller(name):
        async for _ in eng.generate("hello", long, request_id=name):
            broken.set()  # the loop dies on its next step
        return "finished"

    async def go():
        t0 = time.monotonic()
        results = await asyncio.wait_for(
            asyncio.gather(caller("running"), caller("queued"), return_exceptions=True), timeout=10)
        assert all(isinstance(r, EngineDeadError) for r in results), results
        assert time.monotonic() - t0 < 5
        assert not eng.is_ready
        with pytest.raises(EngineDeadError):
            await eng.call(lambda: 1)
        resumed.set()
        for _ in range(100):
            if eng.is_ready:
                break
            await asyncio.sleep(0.05)
        assert eng.is_ready and eng.restarts == 1
        outs = [o async for o in eng.generate("hello", GREEDY)]
        assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 6

    try:
        asyncio.run(go())
    finally:
        resumed.set()
        eng.shutdown()
    assert not eng.is_ready


def steps_until_quiet_finishes(model_dir, policy: str) -> int:
    engine = make_engine(model_dir, blocks=4096, max_num_seqs=64, max_num_batched_tokens=256,
                         fairness_policy=policy)
    flood = SamplingParams(n=32, temperature=1.0, max_tokens=32, ignore_eos=True)
    for i in range(8):  # 256 sequences
        engine.add_request(f"flood{i}", f"flood {i}", flood, fairness_key="flood")
    for _ in range(2):
        engine.step()
    engine.add_request("quiet", "quiet one", SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                       fairness_key="quiet")
    for step in range(1, 1000):
        if any(o.request_id == "quiet" and o.finished for o in engine.step()):
            return step
    raise AssertionError("the quiet request never finished")


@pytest.mark.slow
def test_a_flooding_key_does_not_starve_a_quiet_one(tiny_model_dir):
    fair = steps_until_quiet_finishes(tiny_model_dir, "vtc")
    fifo = steps_until_quiet_finishes(tiny_model_dir, "fcfs")
    print("steps until the quiet request finished: vtc", fair, "fcfs", fifo)
    assert fair <= 12, (fair, fifo)  # 8 tokens: admitted within a few steps
    assert fifo > 3 * fair, (fair, fifo)


@pytest.mark.latency
def test_a_slow_grammar_times_out_off_the_engine_thread(engine):
    from loramux.engine.async_engine import AsyncEngine
    from loramux.engine.structured_output import GrammarTimeoutError

    structured = engine.structured
    structured.compile_timeout = 0.3
    original = structured._compile

    def slow_compile(params):
        if params.regex == "slow":
            time.sleep(1.5)
        return original(params)

    structured._compile = slow_compile
    structured._xgr()  # the tokenizer's vocabulary is read once, up front
    eng = AsyncEngine(engine)

    async def neighbour():
        t0 = time.monotonic()
        outs = [o async for o in eng.generate("hello", GREEDY)]
        return outs[-1], time.monotonic() - t0

    async def slow():
        params = SamplingParams(max_tokens=4, structured_outputs={"regex": "slow"})
        async for _ in eng.generate("x", params):
            pass

    async def go():
        t0 = time.monotonic()
        failed, (last, took) = await asyncio.gather(slow(), neighbour(), return_exceptions=True)
        assert isinstance(failed, GrammarTimeoutError) and "did not compile within" in str(failed)
        assert time.monotonic() - t0 < 1.2 and last.finished and took < 1.2  # nobody waited on it
        for _ in range(100):  # it finishes compiling in the background: cached, it then runs
            if len(structured._cache) == 1:
                break
            await asyncio.sleep(0.05)
        outs = [o async for o in eng.generate("x", SamplingParams(max_tokens=4, structured_outputs={"regex": "slow"}))]
        assert outs[-1].outputs[0].text == "slow"

    try:
        asyncio.run(go())
    finally:
        eng.shutdown()


def test_a_full_queue_refuses_the_flooding_key_not_its_neighbour(tiny_model_dir):
    from loramux.engine.engine import QueueFullError

    engine = make_engine(tiny_model_dir, max_waiting=4)
    params = SamplingParams(max_tokens=2)
    for i in range(4):
        engine.add_request(f"flood-{i}", [1, 2, 3], params, fairness_key="flood")
    with pytest.raises(QueueFullError):
        engine.add_request("flood-4", [1, 2, 3], params, fairness_key="flood")
    engine.add_request("quiet-0", [1, 2, 3], params, fairness_key="quiet")  # its share: 4 // 2
    engine.add_request("quiet-1", [1, 2, 3], params, fairness_key="quiet")
    with pytest.raises(QueueFullError):
        engine.add_request("quiet-2", [1, 2, 3], params, fairness_key="quiet")
    assert set(run_all(engine)) == {*(f"flood-{i}" for i in range(4)), "quiet-0", "quiet-1"}
