"""Load a Llama-family Hugging Face folder (safetensors) into fused tensors."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}


class ModelLoadError(ValueError):
    """The folder is not a loadable Llama-family model."""


@dataclass
class ModelDims:
    """Shapes of the base model that the runner, the KV cache and LoRA slots use."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    sliding_window: int | None

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def module_shapes(self) -> dict[str, tuple[int, int]]:
        """(in_features, out_features) of every LoRA-targetable projection."""
        h, i = self.hidden_size, self.intermediate_size
        return {
            "q_proj": (h, self.q_size),
            "k_proj": (h, self.kv_size),
            "v_proj": (h, self.kv_size),
            "o_proj": (self.q_size, h),
            "gate_proj": (h, i),
            "up_proj": (h, i),
            "down_proj": (i, h),
        }


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
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    window = getattr(config, "sliding_window", None)
    if not getattr(config, "use_sliding_window", True):
        window = None
    return ModelDims(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_layers=config.num_hidden_layers,
        num_heads=config.num_attention_heads,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
        head_dim=head_dim,
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
