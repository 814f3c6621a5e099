"""The public seams the platform uses: one ``EngineStats`` shape from both engines, the
adapter residency actions, and the read-only facts, without touching ``AsyncEngine.engine``."""

from __future__ import annotations

import asyncio
import dataclasses

from support.adapters import write_random_adapter
from support.server import make_engine

from loramux.engine.async_engine import AdapterGoneError
from loramux.engine.lora_request import LoRARequest
from loramux.engine.outputs import EngineStats
from loramux.engine.sampling_params import SamplingParams


def _tier(snapshot, key: str) -> str | None:
    return next((r["tier"] for r in snapshot.rows if r["name"] == key), None)


def test_stats_one_shape_and_residency_actions(tiny_model_dir, tmp_path):
    eng = make_engine(tiny_model_dir, max_model_len=128, max_num_seqs=2, max_loras=1)
    a = LoRARequest("a", 1, str(write_random_adapter(tiny_model_dir, tmp_path / "a", seed=1)))
    b = LoRARequest("b", 2, str(write_random_adapter(tiny_model_dir, tmp_path / "b", seed=2)))
    try:
        stats = eng.stats()
        assert isinstance(stats, EngineStats) and type(eng.engine.stats()) is EngineStats
        assert dataclasses.asdict(stats).keys() == dataclasses.asdict(eng.engine.stats()).keys()
        assert eng.is_ready and eng.lora_enabled and eng.max_model_len == 128
        assert eng.model_path.is_dir() and eng.dtype == "float32" and eng.device == "cpu"
        assert eng.tokenizer is eng.engine.tokenizer and eng.config is eng.engine.config

        async def go():
            for r in (a, b):
                await eng.register_adapter(r)
            assert await eng.warm_adapter("a", timeout=10)
            assert _tier(await eng.lora_snapshot(), "a") in ("gpu", "device")
            await eng.pin_adapter("a")
            assert not await eng.warm_adapter("b", timeout=2)  # the one slot is pinned
            await eng.unpin_adapter("a")
            assert await eng.warm_adapter("b", timeout=10)  # a leaves the slot for b
            assert await eng.evict_adapter("b") == (True, False)
            assert await eng.evict_adapter("b") == (False, False)  # not in a slot any more
            assert _tier(await eng.lora_snapshot(), "b") == "cpu"

        asyncio.run(go())
    finally:
        eng.shutdown()


def test_drop_adapter_fails_queued_requests(tiny_model_dir, tmp_path):
    eng = make_engine(tiny_model_dir, max_model_len=256, max_num_seqs=1, max_loras=2)
    x = LoRARequest("x", 1, str(write_random_adapter(tiny_model_dir, tmp_path / "x", seed=3)))
    long = SamplingParams(max_tokens=100, ignore_eos=True, temperature=0)

    async def last(agen):
        return [o async for o in agen][-1]

    async def go():
        running = asyncio.create_task(last(eng.generate([1, 2, 3], long, "run", None)))
        while eng.stats().num_running == 0:
            await asyncio.sleep(0.005)
        queued = asyncio.create_task(last(eng.generate([1, 2], long, "queued", x)))
        while eng.stats().num_waiting == 0:
            await asyncio.sleep(0.005)
        failed = await asyncio.to_thread(eng.drop_adapter, "x", "x was deleted")
        assert failed == ["queued"]
        try:
            await queued
            raise AssertionError("the queued request of a dropped adapter ran")
        except AdapterGoneError as e:
            assert "x was deleted" in str(e)
        assert (await running).finished

    try:
        asyncio.run(go())
    finally:
        eng.shutdown()
    assert eng.drop_adapter("x", "gone") == []  # a stopped engine: nothing to drop
