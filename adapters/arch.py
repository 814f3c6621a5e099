"""The one description of a base model's architecture: which models are supported, the
projections LoRA may target, and their shapes. The adapter validator checks LoRA
tensors against it and the engine (``engine.model.weights.ModelDims``) extends it with
what the forward pass needs."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from loramux.adapters.errors import AdapterValidationError

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}
"""Hugging Face ``architectures`` entries → ``model_type``."""
SUPPORTED_MODEL_TYPES = tuple(dict.fromkeys(SUPPORTED_ARCHITECTURES.values()))
ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
SUPPORTED_MODULES = ATTENTION_MODULES + MLP_MODULES
MODULE_PARENT = {**{m: "self_attn" for m in ATTENTION_MODULES}, **{m: "mlp" for m in MLP_MODULES}}

# base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight
TENSOR_KEY_RE = re.compile(
    r"^base_model\.model\.model\.layers\.(?P<layer>\d{1,6})\.(?P<parent>self_attn|mlp)\."
    r"(?P<module>[A-Za-z0-9_]+)\.lora_(?P<which>[AB])\.weight$"
)


def tensor_key(layer: int, module: str, which: str) -> str:
    """PEFT's saved name for one LoRA tensor (``which`` is ``"A"`` or ``"B"``)."""
    return f"base_model.model.model.layers.{layer}.{MODULE_PARENT[module]}.{module}.lora_{which}.weight"


@dataclass(frozen=True)
class BaseModelDims:
    """The dimensions of a Llama-family base model that LoRA tensor shapes depend on."""

    model_type: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    name_or_path: str | None = None

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def module_shapes(self) -> dict[str, tuple[int, int]]:
        """``(in_features, out_features)`` of every LoRA-targetable projection."""
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

    def module_shape(self, module: str) -> tuple[int, int]:
        """``(in_features, out_features)`` of one projection."""
        return self.module_shapes()[module]


def _positive_int(cfg: Mapping[str, Any], key: str) -> int:
    value = cfg.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise AdapterValidationError(
            f"base model config: {key} must be a positive integer, got {value!r}", field=key
        )
    return value


def base_dims(base_config: Any) -> BaseModelDims:
    """Read the dimensions from a transformers ``PretrainedConfig`` or a ``config.json`` dict."""
    if isinstance(base_config, BaseModelDims):
        return base_config
    if isinstance(base_config, Mapping):
        cfg = dict(base_config)
        name = cfg.get("_name_or_path") or cfg.get("name_or_path")
    elif hasattr(base_config, "to_dict"):
        cfg = base_config.to_dict()
        name = getattr(base_config, "name_or_path", None) or cfg.get("_name_or_path")
    else:
        raise TypeError(
            f"base_config must be a PretrainedConfig or a dict, got {type(base_config)!r}"
        )
    model_type = cfg.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise AdapterValidationError(
            f"base model type {model_type!r} is not supported; expected one of "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}",
            field="model_type",
        )
    hidden = _positive_int(cfg, "hidden_size")
    heads = _positive_int(cfg, "num_attention_heads")
    kv_heads = cfg.get("num_key_value_heads") or heads
    head_dim = cfg.get("head_dim") or hidden // heads
    return BaseModelDims(
        model_type=model_type,
        num_layers=_positive_int(cfg, "num_hidden_layers"),
        hidden_size=hidden,
        intermediate_size=_positive_int(cfg, "intermediate_size"),
        num_heads=heads,
        num_kv_heads=int(kv_heads),
        head_dim=int(head_dim),
        name_or_path=str(name) if name else None,
    )
