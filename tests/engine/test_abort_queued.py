"""``AsyncEngine.fail_waiting``: the queued requests of an adapter fail at once with
``AdapterGoneError``; a running request of the same adapter and requests of other
adapters go on to the end."""

from __future__ import annotations

import asyncio
import time

import pytest
from support.adapters import write_random_adapter
from support.server import make_engine

from loramux.engine.async_engine import AdapterGoneError
from loramux.engine.lora_request import LoRARequest
from loramux.engine.sampling_params import SamplingParams


async def _last(agen):
    outs = [out async for out in agen]
    return outs[-1]


@pytest.mark.latency
def test_abort_queued_fails_only_queued_requests(tiny_model_dir, tmp_path):
    eng = make_engine(tiny_model_dir, max_model_len=256, max_num_seqs=1, max_loras=2)
    x = LoRARequest("x", 1, str(write_random_adapter(tiny_model_dir, tmp_path / "x", seed=1)))
    y = LoRARequest("y", 2, str(write_random_adapter(tiny_model_dir, tmp_path / "y", seed=2)))
    long = SamplingParams(max_tokens=120, ignore_eos=True, temperature=0)
    short = SamplingParams(max_tokens=4, temperature=0)

    async def go():
        running = asyncio.create_task(_last(eng.generate([1, 2, 3], long, "run-x", x)))
        def started() -> bool:
            req = eng.engine.requests.get("run-x")
            return req is not None and any(s.num_computed_tokens for s in req.seqs)

        while not await eng.call(started):
            await asyncio.sleep(0.005)
        queued_x = asyncio.create_task(_last(eng.generate([1, 2], short, "q-x", x)))
        queued_y = asyncio.create_task(_last(eng.generate([1, 2], short, "q-y", y)))
        await asyncio.sleep(0.05)
        start = time.monotonic()
        aborted = await eng.call(lambda: eng.fail_waiting("x", "adapter x was deleted"))
        assert aborted == ["q-x"]
        try:
            await asyncio.wait_for(queued_x, 1.0)
        except AdapterGoneError as e:
            assert "adapter x was deleted" in str(e)
        else:
            raise AssertionError("the queued request did not fail")
        assert time.monotonic() - start < 1.0
        assert len((await running).outputs[0].token_ids) == 120
        assert len((await queued_y).outputs[0].token_ids) == 4
        assert not await eng.call(lambda: bool(eng.engine.requests))

    try:
        asyncio.run(asyncio.wait_for(go(), 60))
    finally:
        eng.shutdown()
