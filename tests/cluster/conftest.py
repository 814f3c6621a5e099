"""Redis fixtures: the shared test server (``redis_url``; keys namespaced per test, deleted
after), and a private ``redis-server`` on a free port for tests that kill it."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
import uuid

import pytest
from support.server import free_port
from support.services import require_service


@pytest.fixture
def redis_client(redis_url):
    import redis

    client = redis.Redis.from_url(redis_url, socket_timeout=2, socket_connect_timeout=2)
    yield client
    client.close()


@pytest.fixture
def namespace(redis_client):
    ns = f"lmxtest-{uuid.uuid4().hex[:10]}"
    yield ns
    keys = list(redis_client.scan_iter(f"{ns}:*"))
    if keys:
        redis_client.delete(*keys)


class PrivateRedis:
    """A ``redis-server`` this test owns (never the shared one): start, kill, restart."""

    def __init__(self):
        self.port = free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            ["redis-server", "--bind", "127.0.0.1", "--port", str(self.port), "--save", "",
             "--appendonly", "no"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("private redis-server did not start")

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(5)
            self.proc = None


def _private_redis():
    require_service(shutil.which("redis-server") is not None, "redis-server")
    r = PrivateRedis()
    r.start()
    try:
        yield r
    finally:
        r.kill()


@pytest.fixture
def private_redis():
    yield from _private_redis()


@pytest.fixture(scope="module")
def module_private_redis():
    """One private Redis for a whole module (the multi-process cluster's)."""
    yield from _private_redis()
