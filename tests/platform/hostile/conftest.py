"""Fixtures of the hostile-tenant suite: a live server on loopback (uvicorn in a thread)
over a tiny-model engine and a throwaway registry with two tenants, ``attacker`` and
``neighbour``, each with its own adapter. Every attack runs beside the neighbour's
canary request, whose latency is compared with its idle latency (:class:`Canary`)."""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from support.adapters import write_random_adapter
from support.platform_settings import settings
from support.server import make_registry, serve_in_thread

from loramux.platform.app import create_app

CANARY_SLACK = 5.0
"""A canary may take this many times its idle latency (plus ``CANARY_FLOOR_S``): the
tests share two cores with other work, so the bound is loose; the stalls it guards
against (a frozen loop, a starved tenant) lasted tens of seconds to minutes."""
CANARY_FLOOR_S = 1.5


@dataclass
class Tenants:
    registry: object
    attacker: object
    neighbour: object
    attacker_key: str
    neighbour_key: str
    adapter_dirs: list[Path]

    @staticmethod
    def auth(key: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {key}"}


@dataclass
class Canary:
    """The neighbour's small request; ``idle`` is its best latency on a quiet server."""

    url: str
    key: str
    model: str = "neighbour-lora"
    idle: float = 0.0
    seen: list[float] = field(default_factory=list)

    def once(self) -> float:
        start = time.monotonic()
        r = httpx.post(f"{self.url}/v1/completions", headers=Tenants.auth(self.key), timeout=30,
                       json={"model": self.model, "prompt": "hello", "max_tokens": 4,
                             "temperature": 0})
        assert r.status_code == 200, r.text
        return time.monotonic() - start

    def calibrate(self) -> Canary:
        self.once()  # warm: loads the adapter
        self.idle = min(self.once() for _ in range(3))
        return self

    def check(self) -> float:
        """One canary request now; fails when it is slower than the bound."""
        latency = self.once()
        self.seen.append(latency)
        bound = CANARY_SLACK * self.idle + CANARY_FLOOR_S
        assert latency <= bound, f"canary took {latency:.3f} s (idle {self.idle:.3f} s)"
        return latency

    @contextlib.contextmanager
    def beside(self, every: float = 0.05):
        """Canary requests in a thread for as long as the block runs; each is checked."""
        stop = threading.Event()
        errors: list[BaseException] = []

        def run() -> None:
            while not stop.is_set():
                try:
                    self.check()
                except BaseException as e:  # noqa: BLE001 - reported in the test thread
                    errors.append(e)
                    return
                stop.wait(every)

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join(30)
        if errors:
            raise errors[0]
        assert self.seen, "no canary request ran beside the attack"


@pytest.fixture(scope="module")
def tenants(tiny_model_dir, tmp_path_factory) -> Tenants:
    root = tmp_path_factory.mktemp("hostile")
    dirs = [write_random_adapter(tiny_model_dir, root / f"a{i}", seed=10 + i, std=0.3)
            for i in range(3)]
    registry = make_registry(root / "registry", tiny_model_dir, max_lora_rank=16)
    attacker, attacker_key = registry.create_tenant("attacker")
    neighbour, neighbour_key = registry.create_tenant("neighbour")
    registry.upload(attacker.id, "attacker-lora", dirs[0])
    registry.upload(neighbour.id, "neighbour-lora", dirs[1])
    yield Tenants(registry, attacker, neighbour, attacker_key, neighbour_key, dirs)
    registry.db.dispose()


@pytest.fixture
def live(engine, tenants):
    """``live(**settings)`` → (base URL, calibrated neighbour canary) of a server with
    those settings; stopped at the end of the test."""
    default_engine = engine  # tests/platform/conftest.py's tiny-model engine
    with contextlib.ExitStack() as stack:
        def start(engine=None, canary_model="neighbour-lora", **overrides):
            app = create_app(settings(**overrides), engine=engine or default_engine,
                             registry=tenants.registry)
            url = stack.enter_context(serve_in_thread(app))
            return url, Canary(url, tenants.neighbour_key, canary_model).calibrate()
        yield start
