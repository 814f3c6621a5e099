"""Fixtures for adapter tests: PEFT-made adapters on the tiny random Llama."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch


def make_peft_adapter(base_dir: Path, out: Path, *, seed: int = 0, **lora_kwargs) -> Path:
    """Save a PEFT LoRA (random, non-zero B) for the model in ``base_dir`` to ``out``."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    kwargs = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    kwargs.update(lora_kwargs)
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    torch.manual_seed(seed)
    peft_model = get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", **kwargs))
    peft_model.save_pretrained(out, safe_serialization=True)
    return out


@pytest.fixture(scope="session")
def make_adapter():
    """``make_adapter(base_dir, out, **LoraConfig kwargs)`` saves a PEFT adapter."""
    return make_peft_adapter


def _tiny_family_model(path: Path, tokenizer_dir: Path, arch: str) -> Path:
    from transformers import (
        AutoTokenizer,
        MistralConfig,
        MistralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    cfg = dict(
        vocab_size=len(tok),
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        tie_word_embeddings=True,
    )
    torch.manual_seed(1)
    if arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**cfg))
    else:
        model = MistralForCausalLM(MistralConfig(**cfg))
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="session", params=["qwen2", "mistral"])
def family_model_dir(request, tmp_path_factory, default_model_dir) -> Path:
    """Tiny Qwen2 and Mistral models (head_dim * heads != hidden, GQA)."""
    return _tiny_family_model(
        tmp_path_factory.mktemp(request.param), default_model_dir, request.param
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
        target_modules=[
            "q_proj",
            "k_proj",
            "v_proj",
            "o_proj",
            "gate_proj",
            "up_proj",
            "down_proj",
        ],
    )


@pytest.fixture
def adapter_copy(peft_adapter, tmp_path) -> Path:
    """A fresh, editable copy of ``peft_adapter``."""
    import shutil

    dest = tmp_path / "adapter"
    shutil.copytree(peft_adapter, dest)
    return dest
