"""The hostile tests' neighbour: one short greedy request on its own adapter, timed."""

from __future__ import annotations

import statistics
import time

import httpx


def neighbour_request(url: str, key: str, timings: list[str] | None = None) -> tuple[float, str]:
    """(seconds, text) of an 8-token greedy completion on ``neighbour-lora``; its
    ``X-LoRAMux-Timing`` header is appended to ``timings`` when given."""
    start = time.monotonic()
    r = httpx.post(f"{url}/v1/completions", headers={"Authorization": f"Bearer {key}"}, timeout=120,
                   json={"model": "neighbour-lora", "prompt": "the canary says", "max_tokens": 8,
                         "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    if timings is not None:
        timings.append(r.headers.get("X-LoRAMux-Timing", ""))
    body = r.json()
    assert body["usage"]["completion_tokens"] == 8
    return time.monotonic() - start, body["choices"][0]["text"]


def idle_after(url: str, key: str, before: list[tuple[float, str]], engine, runs: int = 5) -> float:
    """The neighbour's idle latency: the median of ``before`` (its runs before an attack) and
    ``runs`` more once the attack stopped and ``engine`` has nothing left running or waiting (an
    attack's aborted requests drained, so these runs are idle too), so a drift of the machine's
    speed during the test (one test's idle runs ranged 45-90 ms) weighs on both sides of the ratio."""
    deadline = time.monotonic() + 30
    while (stats := engine.stats()).num_running or stats.num_waiting:
        assert time.monotonic() < deadline, stats
        time.sleep(0.05)
    after = [neighbour_request(url, key) for _ in range(runs)]
    assert all(text == before[0][1] for _, text in after)  # its output is still its idle one
    return statistics.median(t for t, _ in before + after)
