"""Helpers of the inference-gateway tests (``tests/inference_gateway``): tenants, a live
server with the protocol metrics listener, and reading its series."""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from loramux.platform.app import create_app
from loramux.platform.state import close_state
from support.platform_settings import settings
from support.server import free_port, serve_in_thread


@dataclass
class Tenants:
    registry: object
    alpha: object
    beta: object
    alpha_key: str
    beta_key: str
    model_dir: Path
    adapter_dirs: list[Path]

    @staticmethod
    def auth(key: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {key}"}


@dataclass
class Live:
    """One live server: its URL, its protocol metrics URL, its app state."""

    url: str
    metrics_url: str
    state: object

    def scrape(self) -> dict:
        """The protocol metrics, parsed by prometheus_client: name -> family."""
        r = httpx.get(self.metrics_url, timeout=5)
        assert r.status_code == 200, r.text
        return {f.name: f for f in text_string_to_metric_families(r.text)} | {"_text": r.text}


@contextlib.contextmanager
def live_server(tenants: Tenants, engine, **overrides):
    port = free_port()
    app = create_app(settings(protocol_metrics_port=port, **overrides), engine=engine,
                     registry=tenants.registry)
    try:
        with serve_in_thread(app) as url:
            live = Live(url, f"http://127.0.0.1:{port}/metrics", app.services)
            deadline = time.monotonic() + 10
            while httpx.get(live.metrics_url, timeout=5).status_code != 200:
                assert time.monotonic() < deadline, "the protocol metrics never came up"
                time.sleep(0.02)
            yield live
    finally:
        close_state(app.services)


def sample(families: dict, name: str, **labels) -> object:
    """The one sample of ``name`` whose labels include ``labels``."""
    found = [s for s in families[name].samples
             if all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(found) == 1, (name, labels, families[name].samples)
    return found[0]


def names(value: str) -> set[str]:
    return {n.strip() for n in value.split(",") if n.strip()}




class Stream:
    """A long streaming completion in a thread; ``started`` is set at its first chunk."""

    def __init__(self, url: str, key: str, model: str, max_tokens: int = 120) -> None:
        self.started = threading.Event()
        self.done = threading.Event()
        self.status = None
        self.thread = threading.Thread(target=self._run, args=(url, key, model, max_tokens),
                                       daemon=True)
        self.thread.start()

    def _run(self, url, key, model, max_tokens) -> None:
        body = {"model": model, "prompt": "count with me: one two three", "stream": True,
                "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120,
                          headers=Tenants.auth(key)) as r:
            self.status = r.status_code
            for _ in r.iter_lines():
                self.started.set()
        self.started.set()
        self.done.set()
