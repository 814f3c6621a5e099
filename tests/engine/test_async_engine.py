"""AsyncEngine life cycle on a tiny model."""

from __future__ import annotations

import asyncio

import pytest


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    from loramux.engine import LLM

    return LLM(str(tiny_model_dir), dtype="float32", max_model_len=64)


def test_async_engine_calls_after_shutdown_fail_fast(llm):
    from loramux.engine.async_engine import AsyncEngine, EngineDeadError

    eng = AsyncEngine(llm.llm_engine)
    eng.shutdown()

    async def go():
        with pytest.raises(EngineDeadError):
            await asyncio.wait_for(eng.call(lambda: 1), timeout=5)

    asyncio.run(go())
