"""Load a Llama-family Hugging Face folder (safetensors) into fused tensors."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path

import torch
from safetensors import safe_open

from loramux.adapters.arch import SUPPORTED_ARCHITECTURES, BaseModelDims, base_dims
from loramux.engine.errors import ModelLoadError


@dataclass(frozen=True, kw_only=True)
class ModelDims(BaseModelDims):
    """The base model's description (:class:`~loramux.adapters.arch.BaseModelDims`: layers,
    heads, projection shapes) plus what the runner and the KV cache need."""

    vocab_size: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    sliding_window: int | None


def read_hf_config(path: Path):
    """The transformers config of a model folder, checked for a supported architecture."""
    from transformers import AutoConfig

    if not (path / "config.json").is_file():
        raise ModelLoadError(f"{path} has no config.json: not a Hugging Face model folder")
    config = AutoConfig.from_pretrained(path)
    archs = getattr(config, "architectures", None) or []
    if not any(a in SUPPORTED_ARCHITECTURES for a in archs):
        raise ModelLoadError(
            f"{path}: architecture {archs or config.model_type!r} is not supported; "
            f"loramux runs {', '.join(sorted(SUPPORTED_ARCHITECTURES))}"
        )
    return config


def dims_from_config(config) -> ModelDims:
    """The engine's dimensions: the shared description (``base_dims``) plus the rest."""
    window = getattr(config, "sliding_window", None)
    if not getattr(config, "use_sliding_window", True):
        window = None
    base = base_dims(config)
    return ModelDims(
        **{f.name: getattr(base, f.name) for f in fields(BaseModelDims)},
        vocab_size=config.vocab_size,
        rms_norm_eps=config.rms_norm_eps,
        max_position_embeddings=config.max_position_embeddings,
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        qkv_bias=config.model_type == "qwen2" or bool(getattr(config, "attention_bias", False)),
        sliding_window=window,
    )


def _safetensor_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / n for n in names]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        bins = sorted(p.name for p in path.glob("*.bin"))
        hint = " (found pickle weights; convert them to safetensors)" if bins else ""
        raise ModelLoadError(f"{path} has no .safetensors weights{hint}")
    return files


def load_state_dict(path: Path, dtype: torch.dtype, device: torch.device) -> dict[str, torch.Tensor]:
    """Every tensor of the folder, cast to ``dtype`` on ``device``."""
    tensors: dict[str, torch.Tensor] = {}
    for file in _safetensor_files(path):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for key in f.keys():
                tensors[key] = f.get_tensor(key).to(device=device, dtype=dtype)
    return tensors
