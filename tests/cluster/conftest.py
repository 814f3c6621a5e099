"""Redis fixtures: the shared server at 127.0.0.1:6379 (keys namespaced per test, deleted
after), and a private ``redis-server`` on a free port for tests that kill it."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
import uuid

import pytest

REDIS_URL = os.environ.get("LORAMUX_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
IN_CI = os.environ.get("CI", "").lower() == "true"


def _skip_or_fail(what: str) -> None:
    if IN_CI:
        pytest.fail(f"{what} is required under CI=true but is not available")
    pytest.skip(f"{what} is not available")


@pytest.fixture
def redis_client():
    import redis

    client = redis.Redis.from_url(REDIS_URL, socket_timeout=2, socket_connect_timeout=2)
    try:
        client.ping()
    except redis.RedisError:
        _skip_or_fail(f"Redis ({REDIS_URL})")
    yield client
    client.close()


@pytest.fixture
def namespace(redis_client):
    ns = f"lmxtest-{uuid.uuid4().hex[:10]}"
    yield ns
    keys = list(redis_client.scan_iter(f"{ns}:*"))
    if keys:
        redis_client.delete(*keys)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
    if shutil.which("redis-server") is None:
        _skip_or_fail("redis-server")
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
