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

IN_CI = os.environ.get("CI", "").lower() == "true"


def require_service(available: bool, what: str) -> None:
    """Skip when a service is absent, except under CI=true where absence is a failure."""
    if available:
        return
    if IN_CI:
        pytest.fail(f"{what} is required under CI=true but is not reachable")
    pytest.skip(f"{what} is not reachable")


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """The real default model (SmolLM2-135M-Instruct) as a float32 safetensors folder."""
    from loramux.engine.default_model import default_model_path

    return default_model_path()


def make_tiny_llama(
    path: Path,
    tokenizer_dir: Path,
    *,
    seed: int = 0,
    **overrides,
) -> Path:
    """Write a tiny random Llama-family model (safetensors + the default tokenizer) to ``path``."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    cfg = dict(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    arch = overrides.pop("architecture", "llama")
    cfg.update(overrides)
    torch.manual_seed(seed)
    if arch == "qwen2":
        from transformers import Qwen2Config, Qwen2ForCausalLM

        model = Qwen2ForCausalLM(Qwen2Config(**cfg))
    elif arch == "mistral":
        from transformers import MistralConfig, MistralForCausalLM

        model = MistralForCausalLM(MistralConfig(**cfg))
    else:
        model = LlamaForCausalLM(LlamaConfig(**cfg))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.08)
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, default_model_dir) -> Path:
    """A tiny random Llama (2 layers, hidden 64, GQA) with the default tokenizer."""
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), default_model_dir)


def read_json(path: Path) -> dict:
    return json.loads(Path(path).read_text())
