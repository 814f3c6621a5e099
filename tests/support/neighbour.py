"""The hostile tests' neighbour: one short greedy request on its own adapter, timed."""

from __future__ import annotations

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
