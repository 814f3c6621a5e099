"""The protocol-metrics listener process and its feed: 503 before facts and on stale
facts, bad lines ignored, a clear error when the port is taken, a restart when the
process dies, an exit when the server goes away."""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import time

import httpx
import pytest
from support.server import free_port

from loramux.platform.inference_gateway.exposition import ProtocolFacts
from loramux.platform.inference_gateway.metrics_listener import (
    ListenerStartError,
    ProtocolMetricsListener,
)

FACTS = ProtocolFacts(model_name="m", taken_at=0.0, num_running=1, num_waiting=0,
                      kv_cache_usage=0.5, block_size=16, num_gpu_blocks=10,
                      enable_prefix_caching=True, gpu_memory_utilization=0.9, lora_enabled=False)


class Feed:
    """A settable report for the listener; ``to_facts`` stamps it now (or ``age`` ago)."""

    def __init__(self) -> None:
        self.report = None
        self.age = 0.0

    def to_facts(self, report) -> ProtocolFacts:
        return dataclasses.replace(FACTS, taken_at=time.time() - self.age,
                                   num_running=report)


def wait_status(url: str, status: int, timeout: float = 10) -> httpx.Response:
    deadline = time.monotonic() + timeout
    while True:
        try:
            r = httpx.get(url, timeout=5)
            if r.status_code == status:
                return r
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, f"never {status}"
        time.sleep(0.02)


def test_starting_fresh_stale_restart_and_exit():
    port = free_port()
    feed = Feed()
    listener = ProtocolMetricsListener("127.0.0.1", port, lambda: feed.report, feed.to_facts)
    url = f"http://127.0.0.1:{port}/metrics"
    try:
        assert "starting" in wait_status(url, 503).text
        feed.report = 3
        assert 'vllm:num_requests_running{engine="0",model_name="m"} 3.0' in wait_status(url, 200).text
        feed.age, feed.report = 60.0, 4  # the engine stopped reporting a minute ago
        assert "has not reported" in wait_status(url, 503).text
        feed.age, feed.report = 0.0, 5
        wait_status(url, 200)
        os.kill(listener.pid, signal.SIGKILL)  # the process dies: the feed restarts it
        old = listener.pid
        deadline = time.monotonic() + 15
        while listener.pid == old:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        feed.report = 6
        assert "} 6.0" in wait_status(url, 200, timeout=15).text
        pid = listener.pid
    finally:
        listener.close()
    with pytest.raises(ProcessLookupError):  # stdin closed: it exited
        os.kill(pid, 0)


def test_a_taken_port_is_a_clear_error():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(ListenerStartError, match=f"127.0.0.1:{port}"):
            ProtocolMetricsListener("127.0.0.1", port, lambda: None, lambda r: FACTS)


def test_bad_lines_are_ignored():
    import io

    from loramux.platform.inference_gateway.metrics_process import Latest, feed

    latest, ended = Latest(), []
    line = dataclasses.replace(FACTS, taken_at=time.time()).to_json()
    feed(latest, io.BytesIO(b"not json\n{}\n" + line + b"\n"), lambda: ended.append(1))
    body, age = latest.body()
    assert b"vllm:kv_cache_usage_perc" in body and age < 5 and ended == [1]
