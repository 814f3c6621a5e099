"""Inter-token latency metrics (gaps between token-producing steps, misses of the engine's
ITL target) and the ``X-LoRAMux-Timing`` header (ms per phase of the request)."""

from __future__ import annotations

import json

from prometheus_client.parser import text_string_to_metric_families
from support.platform_settings import ADMIN_KEY, BASE

from loramux.platform.metrics import Metrics
from loramux.platform.openai.timing import PHASES, TIMING_HEADER

ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


def _families(text: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(text)}


def _sample(families: dict, family: str, name: str, **labels) -> float:
    for s in families[family].samples:
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
            return s.value
    raise AssertionError(f"no {name} {labels} in {family}")


def test_itl_gaps_and_misses_are_counted_per_adapter():
    m = Metrics()
    m.observe_itl("a", [0.01, 0.02, 0.5], 1, 0.1)
    m.observe_itl("b", [0.01], 0, 0.1)
    fam = _families(m.render().decode())
    assert _sample(fam, "loramux_inter_token_latency_seconds",
                   "loramux_inter_token_latency_seconds_count", adapter="a") == 3
    assert _sample(fam, "loramux_inter_token_latency_seconds",
                   "loramux_inter_token_latency_seconds_bucket", adapter="a", le="0.1") == 2
    assert _sample(fam, "loramux_itl_misses", "loramux_itl_misses_total", adapter="a") == 1
    assert _sample(fam, "loramux_itl_misses", "loramux_itl_misses_total", adapter="b") == 0
    assert _sample(fam, "loramux_itl_target_seconds", "loramux_itl_target_seconds") == 0.1


def _timing(value: str) -> dict[str, float]:
    out = {}
    for part in value.split(", "):
        name, dur = part.split(";dur=")
        out[name] = float(dur)
    return out


async def test_timing_header_and_itl_series_of_a_request(client, env):
    before = _families((await client.get("/metrics", headers=ADMIN)).text)

    def gaps(fam) -> float:
        try:
            return _sample(fam, "loramux_inter_token_latency_seconds",
                           "loramux_inter_token_latency_seconds_count", adapter="base")
        except (AssertionError, KeyError):
            return 0.0

    body = {"model": BASE, "prompt": "hello there", "max_tokens": 6, "temperature": 0,
            "ignore_eos": True}
    r = await client.post("/v1/completions", json=body, headers=env.headers(env.key_a))
    assert r.status_code == 200, r.text
    timing = _timing(r.headers[TIMING_HEADER])
    assert list(timing) == list(PHASES)
    assert all(v >= 0 for v in timing.values())
    assert timing["adapter_load"] == 0.0  # the base model waits for no adapter
    assert timing["decode"] > 0  # 5 steps after the first token
    after = _families((await client.get("/metrics", headers=ADMIN)).text)
    assert gaps(after) - gaps(before) == 5  # 6 tokens, one gap between each two
    assert _sample(after, "loramux_itl_target_seconds", "loramux_itl_target_seconds") >= 0

    r = await client.post("/v1/completions", json={**body, "stream": True},
                          headers=env.headers(env.key_a))
    assert r.status_code == 200
    assert list(_timing(r.headers[TIMING_HEADER])) == list(PHASES[:3])  # sent with the first token
    chunks = [json.loads(line[6:]) for line in r.text.splitlines()
              if line.startswith("data: {")]
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"])


async def test_an_adapter_request_reports_its_load_wait(client, env):
    """The first request of an adapter no slot holds waits for its load; the next does not."""
    body = {"model": "a-only", "prompt": "hi", "max_tokens": 3, "temperature": 0}
    first, again = [
        _timing((await client.post("/v1/completions", json=body, headers=env.headers(env.key_a)))
                .headers[TIMING_HEADER]) for _ in range(2)]
    assert 0 < first["adapter_load"] <= first["queue"]
    assert again["adapter_load"] == 0.0
