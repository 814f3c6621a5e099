"""A client that disconnects aborts its request: the KV usage gauge returns to idle."""

from __future__ import annotations

import re
import time

import httpx
import pytest
from support.server import make_engine, serve_in_thread

from loramux.platform.app import create_app
from loramux.platform.settings import Settings
from loramux.platform.state import close_state

BASE = "tiny-base"
MAX_TOKENS = 480


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    engine = make_engine(tiny_model_dir, max_model_len=512, max_num_seqs=8, enable_lora=False)
    app = create_app(Settings(served_model_name=[BASE], allow_anonymous=True, metrics_public=True),
                     engine=engine)
    with serve_in_thread(app) as url:
        yield url, engine
    close_state(app.services)
    engine.shutdown()


def metric(url: str, name: str, labels: str = "") -> float:
    text = httpx.get(f"{url}/metrics").text
    m = re.search(rf"^{re.escape(name)}{re.escape(labels)} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def wait_idle(url: str, timeout: float = 5.0) -> float:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        usage = metric(url, "loramux_kv_cache_usage_perc")
        running = metric(url, "loramux_num_requests_running")
        if usage == 0.0 and running == 0.0:
            return usage
        time.sleep(0.02)
    return metric(url, "loramux_kv_cache_usage_perc")


@pytest.mark.latency
def test_stream_disconnect_frees_blocks(server):
    url, engine = server
    idle = wait_idle(url)
    assert idle == 0.0
    body = {"model": BASE, "prompt": "Tell me a very long story", "max_tokens": MAX_TOKENS,
            "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=url, timeout=30) as c:
        with c.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            got = 0
            for line in lines:
                if line.startswith("data: "):
                    got += 1
                    if got == 3:
                        break
            assert metric(url, "loramux_kv_cache_usage_perc") > 0.0  # still generating
        # leaving the block closes the connection mid-stream
    t0 = time.monotonic()
    assert wait_idle(url) == 0.0
    assert time.monotonic() - t0 < 2.0
    assert engine.stats().num_running == 0
    cancelled = metric(url, "loramux_requests_total", '{adapter="base",endpoint="completions",status="cancelled"}')
    assert cancelled == 1.0
    generated = metric(url, "loramux_generated_tokens_total", '{adapter="base"}')
    assert 0 < generated < MAX_TOKENS


@pytest.mark.latency  # a 0.15 s read timeout; counts the stream test's cancel before its own
def test_non_stream_disconnect_frees_blocks(server):
    url, engine = server
    body = {"model": BASE, "prompt": "Another long story", "max_tokens": MAX_TOKENS, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{url}/v1/completions", json=body, timeout=httpx.Timeout(30, read=0.15))
    assert wait_idle(url) == 0.0
    assert engine.stats().num_running == 0
    cancelled = metric(url, "loramux_requests_total", '{adapter="base",endpoint="completions",status="cancelled"}')
    assert cancelled == 2.0
