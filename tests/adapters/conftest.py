"""Fixtures for adapter tests: PEFT-made adapters on the tiny random Llama."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.lora_fixtures import make_peft_adapter as _make_peft_adapter
from support.tiny_models import make_tiny_llama

from loramux.adapters.arch import SUPPORTED_MODULES


def make_peft_adapter(base_dir: Path, out: Path, *, seed: int = 0, **lora_kwargs) -> Path:
    """A PEFT LoRA (PEFT's own random, non-zero init) for the model in ``base_dir``."""
    kwargs = dict(r=4, alpha=8, target_modules=["q_proj", "v_proj"])
    kwargs.update(lora_kwargs)
    if "lora_alpha" in kwargs:
        kwargs["alpha"] = kwargs.pop("lora_alpha")
    return _make_peft_adapter(base_dir, out, seed=seed, std=None, **kwargs)


@pytest.fixture(scope="session")
def make_adapter():
    """``make_adapter(base_dir, out, **LoraConfig kwargs)`` saves a PEFT adapter."""
    return make_peft_adapter


@pytest.fixture(scope="session", params=["qwen2", "mistral"])
def family_model_dir(request, tmp_path_factory, default_model_dir) -> Path:
    """Tiny Qwen2 and Mistral models (head_dim * heads != hidden, GQA)."""
    return make_tiny_llama(
        tmp_path_factory.mktemp(request.param), default_model_dir, seed=1,
        architecture=request.param, hidden_size=48, intermediate_size=96, num_attention_heads=6,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
    )


@pytest.fixture(scope="session")
def tiny_config(tiny_model_dir) -> dict:
    return json.loads((tiny_model_dir / "config.json").read_text())


@pytest.fixture(scope="session")
def peft_adapter(tiny_model_dir, tmp_path_factory) -> Path:
    """A PEFT adapter on q/k/v/o and the MLP of the tiny model."""
    return make_peft_adapter(
        tiny_model_dir,
        tmp_path_factory.mktemp("peft-adapter"),
        target_modules=list(SUPPORTED_MODULES),
    )


@pytest.fixture
def adapter_copy(peft_adapter, tmp_path) -> Path:
    """A fresh, editable copy of ``peft_adapter``."""
    import shutil

    dest = tmp_path / "adapter"
    shutil.copytree(peft_adapter, dest)
    return dest
