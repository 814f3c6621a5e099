"""Load a Hugging Face model folder (config + safetensors) of a supported architecture."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path

import torch
from safetensors import safe_open

from loramux.adapters.arch import Architecture, BaseModelDims, base_dims, resolve_architecture
from loramux.adapters.errors import AdapterValidationError
from loramux.engine.errors import ModelLoadError


@dataclass(frozen=True, kw_only=True)
class ModelDims(BaseModelDims):
    """The base model's description (:class:`~loramux.adapters.arch.BaseModelDims`: layers,
    heads, projection shapes, architecture) plus what the runner and the KV cache need."""

    vocab_size: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool


def read_hf_config(path: Path):
    """The transformers config of a model folder, checked for a supported architecture.
    (Multimodal checkpoints: the whole config; :func:`text_config` gives the text model's.)"""
    from transformers import AutoConfig

    if not (path / "config.json").is_file():
        raise ModelLoadError(f"{path} has no config.json: not a Hugging Face model folder")
    try:
        resolve_architecture(json.loads((path / "config.json").read_text()))
    except AdapterValidationError as e:
        raise ModelLoadError(f"{path}: {e}") from None
    return AutoConfig.from_pretrained(path)


def text_config(config):
    """The text model's config of ``config`` (itself unless the architecture nests one)."""
    arch = resolve_architecture(config)
    return getattr(config, arch.text_config) if arch.text_config else config


def dims_from_config(config) -> ModelDims:
    """The engine's dimensions: the shared description (``base_dims``) plus the rest."""
    base = base_dims(config)
    text = text_config(config)
    tie = getattr(text, "tie_word_embeddings", None)
    if tie is None:
        tie = getattr(config, "tie_word_embeddings", False)
    return ModelDims(
        **{f.name: getattr(base, f.name) for f in fields(BaseModelDims)},
        vocab_size=text.vocab_size,
        rms_norm_eps=text.rms_norm_eps,
        max_position_embeddings=text.max_position_embeddings,
        tie_word_embeddings=bool(tie),
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


def canonical_name(key: str, arch: Architecture) -> str | None:
    """A checkpoint tensor's name as the loader reads it (``model.layers.…``, ``lm_head.weight``),
    or None for tensors the text model does not use (a vision tower)."""
    for prefix in arch.weight_prefixes:
        if key.startswith(prefix):
            return "model." + key[len(prefix) :]
    if any(key.startswith(p) for p in arch.ignored_prefixes):
        return None
    if key.endswith("lm_head.weight"):
        return "lm_head.weight"
    return key


def load_state_dict(
    path: Path, dtype: torch.dtype, device: torch.device, arch: Architecture | None = None,
    keep_dtype: Callable[[str], bool] | None = None, take: Callable | None = None,
) -> dict[str, torch.Tensor]:
    """Every tensor the text model uses, by :func:`canonical_name`, cast to ``dtype`` on ``device``
    (except those ``keep_dtype(name)`` keeps as stored: a quantized checkpoint's integers and scales).
    ``take(name, slice)``: the part of each tensor to read (a tensor-parallel rank's share, from
    the file's slice, so the rest is never read; None: leave the tensor out)."""
    tensors: dict[str, torch.Tensor] = {}
    for file in _safetensor_files(path):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for key in f.keys():
                name = canonical_name(key, arch) if arch is not None else key
                if name is None:
                    continue
                keep = keep_dtype is not None and keep_dtype(name)
                t = f.get_tensor(key) if take is None else take(name, f.get_slice(key))
                if t is not None:
                    tensors[name] = t.to(device=device, dtype=None if keep else dtype)
    return tensors
