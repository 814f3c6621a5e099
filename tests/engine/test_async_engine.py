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


def test_a_quiet_request_gets_its_first_and_last_outputs_only(llm):
    """``every_step=False`` (a response sent once): the first token's output and the
    finished one, and the same tokens as the request that sees every step."""
    from loramux.engine import SamplingParams
    from loramux.engine.async_engine import AsyncEngine

    eng = AsyncEngine(llm.llm_engine)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)

    async def run(rid: str, every_step: bool) -> list:
        return [out async for out in eng.generate({"prompt_token_ids": [5, 6, 7]}, params, rid,
                                                  every_step=every_step)]

    try:
        loud = asyncio.run(run("loud", True))
        quiet = asyncio.run(run("quiet", False))
        assert len(loud) == 6 and [len(o.outputs[0].token_ids) for o in loud] == list(range(1, 7))
        assert [len(o.outputs[0].token_ids) for o in quiet] == [1, 6]
        assert quiet[-1].finished and not quiet[0].finished
        assert quiet[-1].outputs[0].token_ids == loud[-1].outputs[0].token_ids
    finally:
        eng.shutdown()
