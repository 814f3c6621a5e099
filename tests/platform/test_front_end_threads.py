"""A server built by the app's lifespan leaves OpenMP teams to the engine's thread
(``engine/omp_threads.py``): the event loop's thread runs its torch work alone, the thread that
built the engine frees its pool, the first start's work runs alone, and the engine's thread keeps its
team."""

from __future__ import annotations

import threading

import httpx
import torch
from support.server import serve_in_thread

from loramux.engine import omp_threads
from loramux.platform.app import create_app
from loramux.platform.settings import Settings


def test_the_lifespan_leaves_the_teams_to_the_engine_thread(monkeypatch, tiny_model_dir, tmp_path):
    confined, released = [], []
    real_confine, real_release = omp_threads.confine_thread, omp_threads.release_pool
    monkeypatch.setattr(omp_threads, "confine_thread",
                        lambda: confined.append(threading.current_thread().name) or real_confine())
    monkeypatch.setattr(omp_threads, "release_pool",
                        lambda: released.append(threading.current_thread().name) or real_release())
    app = create_app(Settings(model=str(tiny_model_dir), dtype="float32", max_model_len=128,
                              enable_lora=False, allow_anonymous=True, data_dir=tmp_path,
                              served_model_name=["tiny"]))
    ready = []
    app.on_ready = lambda state: ready.append(torch.get_num_threads())  # the CLI's bootstrap
    with serve_in_thread(app) as url:
        r = httpx.post(f"{url}/v1/completions", timeout=60,
                       json={"model": "tiny", "prompt": "hello", "max_tokens": 4})
        assert r.status_code == 200, r.text
        engine_threads = app.services.engine.call_sync(torch.get_num_threads, timeout=30)
    assert "uvicorn-test" in confined  # the event loop's thread
    assert ready == [1]  # the first start's work (the demo adapter) alone on its worker thread
    assert set(released) - {"uvicorn-test"}  # the builder: a worker of the loop's pool
    assert engine_threads == torch.get_num_threads()  # the engine's thread keeps the process's team
