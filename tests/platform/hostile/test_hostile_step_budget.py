"""The step-time budget over HTTP: one tenant keeps 256 sequences running (8 streams of
``n: 32``), and the neighbour's 8-token greedy request still finishes within 3× its idle
latency, measured in the same test on the same server."""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import threading
import time

import httpx
import pytest
from support.server import make_engine

FLOOD_STREAMS = 8
FLOOD_N = 32


@pytest.fixture(scope="module")
def flood_engine(tiny_model_dir):
    eng = make_engine(tiny_model_dir, max_model_len=512, max_num_seqs=FLOOD_STREAMS * FLOOD_N + 8,
                      max_waiting=64, max_loras=2, max_cpu_loras=4)
    yield eng
    eng.shutdown()


def _quiet(url: str, key: str) -> float:
    start = time.monotonic()
    r = httpx.post(f"{url}/v1/completions", headers={"Authorization": f"Bearer {key}"}, timeout=120,
                   json={"model": "neighbour-lora", "prompt": "hello there", "max_tokens": 8,
                         "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 8
    return time.monotonic() - start


class Flood:
    """``FLOOD_STREAMS`` non-streaming ``n: 32`` requests of the attacker, sent from an
    event loop in a thread (cheap for the test process, which shares one GIL with the
    server); :meth:`stop` cancels them, and the server aborts them on the disconnect."""

    def __init__(self, url: str, key: str) -> None:
        self.url, self.key = url, key
        self.loop = asyncio.new_event_loop()
        self.task: asyncio.Task | None = None
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    async def _send(self) -> None:
        body = {"model": "attacker-lora", "prompt": "flood", "n": FLOOD_N, "max_tokens": 400,
                "temperature": 1.0, "ignore_eos": True}
        async with httpx.AsyncClient(timeout=300) as client:
            await asyncio.gather(*(client.post(f"{self.url}/v1/completions", json=body,
                                               headers={"Authorization": f"Bearer {self.key}"})
                                   for _ in range(FLOOD_STREAMS)))

    def start(self) -> None:
        self.thread.start()
        self.task = asyncio.run_coroutine_threadsafe(self._send(), self.loop)

    def stop(self) -> None:
        self.task.cancel()
        with contextlib.suppress(BaseException):
            self.task.result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)


def test_flood_of_256_sequences_leaves_the_neighbour_within_3x_idle(live, tenants, flood_engine):
    url, _ = live(engine=flood_engine)
    _quiet(url, tenants.neighbour_key)  # warm: loads the adapter
    idle = min(_quiet(url, tenants.neighbour_key) for _ in range(3))
    flood = Flood(url, tenants.attacker_key)
    flood.start()
    try:
        deadline = time.monotonic() + 60
        while flood_engine.stats().num_running < FLOOD_STREAMS * FLOOD_N:
            assert time.monotonic() < deadline, f"flood never reached {FLOOD_STREAMS * FLOOD_N} sequences"
            time.sleep(0.05)
        beside = [_quiet(url, tenants.neighbour_key) for _ in range(5)]  # median of 5: one slow outlier is noise
        running = flood_engine.stats().num_running
    finally:
        flood.stop()
    assert running >= FLOOD_STREAMS * FLOOD_N - 8, running  # the flood was still on
    print(f"quiet beside the flood {beside} s, idle {idle:.3f} s")
    assert statistics.median(beside) <= 3 * idle, f"beside the flood {beside}, idle {idle:.3f} s"
