"""The protocol-metrics listener process: ``python -m
loramux.platform.inference_gateway.metrics_process --host H --port P``.

Why a process: the picker scrapes every 50 ms and wants an answer in well under 10 ms,
but a thread of the server shares the interpreter lock with the engine thread, whose
Python parts hold it for milliseconds (measured on a 2-core machine: a scrape thread
answered in 84 ms p99 beside a busy Python thread).
This process holds no engine: it reads :class:`~.exposition.ProtocolFacts` as JSON lines
on stdin (the server's feed thread writes one whenever the engine's state changed) and
answers ``GET /metrics`` from the last one, rendered once per update.

It prints ``ready`` on stdout once it listens (``error: ...`` when it cannot), and exits
when stdin closes (the server is gone). ``/metrics`` is 503 until the first facts arrive,
and again when the last ones are older than :data:`STALE_AFTER_S` (the engine stopped
reporting: a picker must not route on its old numbers).
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4

from loramux.platform.inference_gateway.exposition import ProtocolFacts, render

STALE_AFTER_S = 10.0
"""Facts older than this are not served (an idle engine reports every 50 ms)."""
MAX_CONNECTIONS = 64
"""Open scrape connections at once; more are closed at once (the picker needs one)."""
IDLE_TIMEOUT_S = 30.0


class Latest:
    """The rendering of the last facts: rendered by the feed thread when they arrive, so
    a scrape only copies bytes (one reference swap: no lock on the scrape path)."""

    def __init__(self) -> None:
        self._latest: tuple[bytes, float] | None = None

    def update(self, facts: ProtocolFacts) -> None:
        self._latest = (render(facts), facts.taken_at)

    def body(self) -> tuple[bytes | None, float]:
        """(the rendering, its age in seconds); (None, inf) before any facts."""
        latest = self._latest
        if latest is None:
            return None, float("inf")
        return latest[0], time.time() - latest[1]


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    timeout = IDLE_TIMEOUT_S
    disable_nagle_algorithm = True  # headers and body are two writes: no 40 ms delayed-ACK stall
    latest: Latest

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        self._answer(head=False)

    def do_HEAD(self) -> None:  # noqa: N802
        self._answer(head=True)

    def _answer(self, head: bool) -> None:
        path = self.path.split("?", 1)[0]
        if path not in ("/metrics", "/"):
            self._plain(404, b"not found: the protocol metrics are at /metrics\n", head)
            return
        body, age = self.latest.body()
        if body is None:
            self._plain(503, b"the engine is starting\n", head)
            return
        if age > STALE_AFTER_S:
            self._plain(503, f"the engine has not reported for {age:.0f} s\n".encode(), head)
            return
        self.send_response(200)
        self.send_header("Content-Type", CONTENT_TYPE_PLAIN_0_0_4)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if not head:
            self.wfile.write(body)

    def _plain(self, status: int, body: bytes, head: bool) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "text/plain; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if not head:
            self.wfile.write(body)

    def log_message(self, format: str, *args) -> None:  # noqa: A002 - no access log
        pass


class Server(ThreadingHTTPServer):
    """A thread per connection, at most :data:`MAX_CONNECTIONS` of them."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address, handler) -> None:
        super().__init__(address, handler)
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)

    def process_request(self, request, client_address) -> None:
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


def feed(latest: Latest, stream, on_eof) -> None:
    """Read facts lines from ``stream`` until it closes, then call ``on_eof``."""
    for line in stream:
        if line.strip():
            try:
                latest.update(ProtocolFacts.from_json(line))
            except (ValueError, TypeError, KeyError) as e:
                print(f"protocol metrics: ignoring a bad facts line: {e}", file=sys.stderr)
    on_eof()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--host", required=True)
    p.add_argument("--port", type=int, required=True)
    args = p.parse_args(argv)
    sys.setswitchinterval(0.0005)  # a scrape thread waits at most this for the feed thread
    latest = Latest()
    Handler.latest = latest
    try:
        server = Server((args.host, args.port), Handler)
    except OSError as e:
        print(f"error: cannot listen on {args.host}:{args.port}: {e}", flush=True)
        return 1
    threading.Thread(target=feed, args=(latest, sys.stdin.buffer, server.shutdown),
                     name="facts-feed", daemon=True).start()
    print("ready", flush=True)
    server.serve_forever(poll_interval=0.5)
    server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
