"""SIGTERM drains: /ready turns 503 and new requests get 503 + Retry-After (not a refused
connection) while the requests in flight finish; a stream still running at
``shutdown_timeout`` ends with an error event and [DONE]; then the server stops."""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import pytest
import uvicorn
from support.platform_settings import BASE, settings
from support.server import free_port, make_engine, make_registry

from loramux.platform.app import create_app
from loramux.platform.drain import AFTER_TIMEOUT_S, DrainingServer
from loramux.platform.state import close_state


@pytest.fixture
def slow_server(tiny_model_dir, tmp_path):
    """A server on a dedicated engine whose steps take 30 ms (a long stream lasts 15 s)."""
    engine = make_engine(tiny_model_dir, max_model_len=512, max_num_seqs=8)
    llm = engine.engine
    real_step = llm.step_requests

    def slow_step(*a, **k):
        time.sleep(0.03)
        return real_step(*a, **k)
    llm.step_requests = slow_step
    registry = make_registry(tmp_path / "reg", tiny_model_dir)
    _, key = registry.create_tenant("acme")
    app = create_app(settings(), engine=engine, registry=registry)
    app.drain.on_timeout.append(lambda: threading.Thread(target=engine.shutdown).start())
    port = free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                            access_log=False, timeout_graceful_shutdown=AFTER_TIMEOUT_S)
    server = DrainingServer(config, drain=app.drain, shutdown_timeout=1.5)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    for _ in range(200):
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                break
        except httpx.TransportError:
            time.sleep(0.05)
    yield server, thread, url, {"Authorization": f"Bearer {key}"}
    server.should_exit = True
    thread.join(10)
    close_state(app.services)
    engine.shutdown()
    registry.db.dispose()


def _stream(url, headers, max_tokens, out: list):
    body = {"model": BASE, "prompt": "hello", "max_tokens": max_tokens, "stream": True,
            "ignore_eos": True, "temperature": 0}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=headers,
                      timeout=60) as r:
        out.append(r.status_code)
        for line in r.iter_lines():
            if line.startswith("data: "):
                out.append(line[6:])


@pytest.mark.latency
def test_sigterm_drains_with_503_then_times_out_with_an_error_event(slow_server):
    server, thread, url, headers = slow_server
    short, long = [], []
    workers = [threading.Thread(target=_stream, args=(url, headers, 20, short)),
               threading.Thread(target=_stream, args=(url, headers, 480, long))]
    for w in workers:
        w.start()
    deadline = time.monotonic() + 30
    while len(long) < 3 and time.monotonic() < deadline:
        time.sleep(0.02)
    t0 = time.monotonic()
    server.handle_exit(signal.SIGTERM, None)
    r = httpx.post(f"{url}/v1/completions", headers=headers, timeout=10,
                   json={"model": BASE, "prompt": "x", "max_tokens": 1})
    assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down"
    assert r.headers["retry-after"] == "1"
    ready = httpx.get(f"{url}/ready", timeout=10)
    assert ready.status_code == 503 and ready.json()["checks"]["accepting"] is False
    for w in workers:
        w.join(30)
    thread.join(30)
    assert not thread.is_alive()
    elapsed = time.monotonic() - t0
    assert 1.5 <= elapsed < 1.5 + AFTER_TIMEOUT_S + 3
    # the short stream finished normally within the drain
    assert short[0] == 200 and short[-1] == "[DONE]"
    assert all("error" not in json.loads(c) for c in short[1:-1])
    # the long one was ended at the timeout with an error event, then [DONE]
    assert long[0] == 200 and long[-1] == "[DONE]"
    assert "error" in json.loads(long[-2])
    assert len(long) < 480


@pytest.mark.latency
def test_sigterm_with_nothing_in_flight_stops_at_once(slow_server):
    server, thread, url, _ = slow_server
    t0 = time.monotonic()
    server.handle_exit(signal.SIGTERM, None)
    thread.join(10)
    assert not thread.is_alive() and time.monotonic() - t0 < 1.5
