"""Helpers for tests and benchmarks (not in the wheel): a small engine, a throwaway
registry, and a live uvicorn server on a free loopback port in a thread. Adapters:
``support.adapters.write_random_adapter``."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from loramux.engine.async_engine import AsyncEngine


def make_engine(
    model_dir: str | Path | None,
    *,
    max_model_len: int = 512,
    max_num_seqs: int = 64,
    max_waiting: int | None = 256,
    enable_lora: bool = True,
    max_loras: int = 4,
    max_lora_rank: int = 16,
    max_cpu_loras: int | None = None,
    dtype: str = "float32",
    device: str = "cpu",
    num_gpu_blocks: int | None = None,
    enable_step_budget: bool = True,
    speculative_config: dict | str | None = None,
) -> AsyncEngine:
    from loramux.engine.config import (
        CacheConfig,
        EngineConfig,
        LoRAConfig,
        ModelConfig,
        SchedulerConfig,
    )
    from loramux.engine.engine import LLMEngine
    from loramux.engine.spec_decode import SpeculativeConfig

    config = EngineConfig(
        model=ModelConfig(model=str(model_dir) if model_dir else None, dtype=dtype, device=device,
                          max_model_len=max_model_len),
        cache=CacheConfig(num_gpu_blocks_override=num_gpu_blocks),
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_waiting=max_waiting,
                                  enable_step_budget=enable_step_budget),
        lora=LoRAConfig(max_loras=max_loras, max_lora_rank=max_lora_rank,
                        max_cpu_loras=max_cpu_loras) if enable_lora else None,
        speculative=SpeculativeConfig.parse(speculative_config),
    )
    return AsyncEngine(LLMEngine(config))


def make_registry(data_dir: str | Path, model_dir: str | Path, **kwargs: Any):
    """A registry with SQLite and a file store under ``data_dir``, checking presets as
    the server does."""
    from loramux.platform.openai.presets import registry_preset_check
    from loramux.registry import build_registry

    data_dir = Path(data_dir)
    return build_registry(
        database_url=f"sqlite:///{data_dir / 'loramux.db'}", data_dir=data_dir,
        base_model=str(model_dir), preset_check=registry_preset_check, **kwargs,
    )


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve_in_thread(app, *, port: int | None = None, log_level: str = "warning",
                    timeout: float = 60.0) -> Iterator[str]:
    """Run ``app`` with uvicorn on 127.0.0.1 in a thread; yields the base URL."""
    import uvicorn

    port = port or free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level=log_level,
                            lifespan="on", access_log=False, timeout_graceful_shutdown=5)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="uvicorn-test", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError("the test server did not start")
        if time.monotonic() > deadline:
            server.should_exit = True
            raise TimeoutError("the test server did not start in time")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=15)


def parse_sse(text: str) -> list:
    """The ``data:`` payloads of a server-sent event stream (JSON decoded, ``[DONE]`` kept)."""
    import json

    events = []
    for block in text.split("\n\n"):
        for line in block.splitlines():
            if line.startswith("data: "):
                payload = line[len("data: "):]
                events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events
