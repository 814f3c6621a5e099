"""Shared fixtures: the default model folder and tiny random Llama-family models."""

from __future__ import annotations

import os

# Everything the tests load is local; never wait on the Hugging Face Hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

# Triton kernels run under the interpreter on machines without a GPU. Must be set
# before anything imports triton.
try:
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
except ImportError:  # pragma: no cover
    pass

import json
from pathlib import Path

import pytest
from support.services import require_service
from support.tiny_models import make_tiny_llama


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """The real default model (SmolLM2-135M-Instruct) as a float32 safetensors folder."""
    from loramux.engine.default_model import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, default_model_dir) -> Path:
    """A tiny random Llama (2 layers, hidden 64, GQA) with the default tokenizer."""
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), default_model_dir)


def read_json(path: Path) -> dict:
    return json.loads(Path(path).read_text())


REDIS_URL = os.environ.get("LORAMUX_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")


@pytest.fixture(scope="session")
def redis_url() -> str:
    """The test Redis server (``LORAMUX_TEST_REDIS_URL``); tests keep to their own key prefix."""
    import redis

    try:
        client = redis.Redis.from_url(REDIS_URL, socket_connect_timeout=3)
        client.ping()
        client.close()
    except Exception:
        require_service(False, f"Redis ({REDIS_URL})")
    return REDIS_URL
