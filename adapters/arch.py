"""The one description of the supported base models, as the rest of the package reads it:
the projections LoRA may target (:mod:`~loramux.adapters.projections`), the families and the
Hugging Face ``architectures`` they serve (:mod:`~loramux.adapters.families`, one row per
family), which architecture a config is, the dimensions and shapes it implies, and what a
checkpoint name says about its model. The adapter validator checks uploads against it; the
engine (``engine.model.registry``) builds the forward pass of the family it names, and its
slots from the shapes (``engine.model.weights.ModelDims`` extends :class:`BaseModelDims`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from loramux.adapters.errors import AdapterValidationError
from loramux.adapters.families import (
    ARCHITECTURES,
    FAMILIES,
    Architecture,
    ModelFamily,
    architecture_of_model_type,
    family_of,
    supported_model_types,
)
from loramux.adapters.projections import (
    ATTENTION_MODULES,
    FUSED_MODULES,
    GROUP_FUSED_MODULE,
    GROUP_OF,
    LORA_MODULES,
    MLP_MODULES,
    MODULE_PARENT,
    NON_TEXT_KEY_RE,
    PROJECTION_GROUPS,
    SUPPORTED_MODULES,
    TENSOR_KEY_RE,
    tensor_key,
)

__all__ = [  # the projections' names re-exported: the package imports them from here
    "ATTENTION_MODULES", "FUSED_MODULES", "GROUP_FUSED_MODULE", "GROUP_OF", "LORA_MODULES",
    "MLP_MODULES", "MODULE_PARENT", "NON_TEXT_KEY_RE", "PROJECTION_GROUPS", "SUPPORTED_MODULES",
    "TENSOR_KEY_RE", "Architecture", "BaseModelDims", "ModelFamily", "base_dims",
    "family_mismatch", "folder_family", "model_types_named", "moe_dims", "resolve_architecture",
    "supported_summary", "tensor_key", "text_config",
]


def supported_summary() -> str:
    """The architectures served, for error messages."""
    return ", ".join(ARCHITECTURES)


def _config_dict(base_config: Any) -> dict[str, Any]:
    if isinstance(base_config, Mapping):
        return dict(base_config)
    if hasattr(base_config, "to_dict"):
        cfg = base_config.to_dict()
        cfg.setdefault("_name_or_path", getattr(base_config, "name_or_path", None))
        return cfg
    raise TypeError(f"base_config must be a PretrainedConfig or a dict, got {type(base_config)!r}")


def resolve_architecture(base_config: Any) -> Architecture:
    """The served architecture of a base model config (its ``architectures``, else its
    ``model_type``). Raises :class:`AdapterValidationError` naming what is supported."""
    cfg = _config_dict(base_config)
    names = cfg.get("architectures") or []
    if isinstance(names, str):
        names = [names]
    model_type = cfg.get("model_type")
    arch = next((ARCHITECTURES[n] for n in names if n in ARCHITECTURES), None)
    if arch is None and not names:
        arch = architecture_of_model_type(model_type)
    if arch is not None and model_type not in (None, arch.config_model_type or arch.model_type):
        names, arch = [], None  # e.g. architectures says Llama, model_type says gpt2
    if arch is None:
        what = f"architecture {names!r}" if names else f"base model type {model_type!r}"
        raise AdapterValidationError(
            f"{what} is not supported; loramux serves {supported_summary()} "
            f"(model types {', '.join(supported_model_types())})",
            field="architectures" if names else "model_type",
        )
    return arch


def text_config(base_config: Any) -> dict[str, Any]:
    """The text model's config as a dict, with transformers' defaults filled in (a
    ``config.json`` may leave out fields whose default is meant), for the resolved
    architecture; multimodal checkpoints give their ``text_config``."""
    arch = resolve_architecture(base_config)
    cfg = _config_dict(base_config)
    name = cfg.get("_name_or_path") or cfg.get("name_or_path")
    if arch.text_config is not None:
        cfg = _config_dict(cfg.get(arch.text_config) or {})
    raw = {k: v for k, v in cfg.items() if k != "model_type"}
    try:
        from transformers import AutoConfig

        full = AutoConfig.for_model(arch.model_type, **raw).to_dict()
    except (ImportError, TypeError, ValueError, KeyError):
        full = dict(raw)  # checked field by field below
    full = {**full, **{k: v for k, v in raw.items() if v is not None}}
    full["model_type"] = arch.model_type
    if name:
        full["_name_or_path"] = name
    return full


@dataclass(frozen=True)
class BaseModelDims:
    """The dimensions of a base model that LoRA tensor shapes depend on."""

    model_type: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    name_or_path: str | None = None
    architecture: str | None = None
    """The Hugging Face architecture (None: the first one of ``model_type``)."""
    num_experts: int = 0
    """Experts per MoE layer (0: a dense model)."""
    num_experts_per_tok: int = 0
    """Experts each token is routed to (the router's top-k)."""
    moe_intermediate_size: int = 0
    """Each expert's intermediate size."""
    moe_layers: tuple[int, ...] = ()
    """The layers whose feed-forward block is the experts (the others are dense MLPs)."""

    def has_module(self, layer: int, module: str) -> bool:
        """Whether ``layer`` has the projection ``module`` (an MoE layer has no dense MLP)."""
        return not (MODULE_PARENT.get(module) == "mlp" and layer in self.moe_layers)

    @property
    def arch(self) -> Architecture:
        if self.architecture is not None:
            return ARCHITECTURES[self.architecture]
        return next(a for a in ARCHITECTURES.values() if a.model_type == self.model_type)

    @property
    def family(self) -> ModelFamily:
        return family_of(self.arch)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def module_shapes(self) -> dict[str, tuple[int, int]]:
        """``(in_features, out_features)`` of every projection a LoRA may target, split and
        fused names alike."""
        h, i = self.hidden_size, self.intermediate_size
        shapes = {
            "q_proj": (h, self.q_size),
            "k_proj": (h, self.kv_size),
            "v_proj": (h, self.kv_size),
            "o_proj": (self.q_size, h),
            "gate_proj": (h, i),
            "up_proj": (h, i),
            "down_proj": (i, h),
        }
        for fused, parts in FUSED_MODULES.items():
            shapes[fused] = (shapes[parts[0]][0], sum(shapes[p][1] for p in parts))
        return shapes

    def module_shape(self, module: str) -> tuple[int, int]:
        """``(in_features, out_features)`` of one projection."""
        return self.module_shapes()[module]

    def group_offsets(self) -> dict[str, list[int]]:
        """Per projection group (``PROJECTION_GROUPS``), where each of its modules' output
        columns start in the group's fused output, and its width last (``[0, q, q+kv, q+2kv]``)."""
        shapes = self.module_shapes()
        out = {}
        for group, modules in PROJECTION_GROUPS.items():
            offs = [0]
            for m in modules:
                offs.append(offs[-1] + shapes[m][1])
            out[group] = offs
        return out


def _positive_int(cfg: Mapping[str, Any], key: str) -> int:
    value = cfg.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise AdapterValidationError(
            f"base model config: {key} must be a positive integer, got {value!r}", field=key
        )
    return value


def base_dims(base_config: Any) -> BaseModelDims:
    """Read the dimensions from a transformers ``PretrainedConfig`` or a ``config.json`` dict
    (any supported architecture; a multimodal one's text model)."""
    if isinstance(base_config, BaseModelDims):
        return base_config
    arch = resolve_architecture(base_config)
    cfg = text_config(base_config)
    hidden = _positive_int(cfg, "hidden_size")
    heads = _positive_int(cfg, "num_attention_heads")
    kv_heads = cfg.get("num_key_value_heads") or heads
    head_dim = cfg.get("head_dim") or hidden // heads
    name = cfg.get("_name_or_path")
    moe = moe_dims(cfg, arch)
    return BaseModelDims(
        model_type=arch.model_type,
        num_layers=_positive_int(cfg, "num_hidden_layers"),
        hidden_size=hidden,
        intermediate_size=_positive_int(cfg, "intermediate_size"),
        num_heads=heads,
        num_kv_heads=int(kv_heads),
        head_dim=int(head_dim),
        name_or_path=str(name) if name else None,
        architecture=arch.name,
        **moe,
    )


def moe_dims(cfg: Mapping[str, Any], arch: Architecture) -> dict[str, Any]:
    """The experts' dimensions of an MoE config (empty for a dense family), read from the
    fields its family's :class:`~loramux.adapters.families.MoEKeys` names: the experts on the
    layers the sparse step picks and the dense-layer list does not keep dense (every layer
    when the family has neither), as transformers builds them."""
    keys = family_of(arch).moe
    if keys is None:
        return {}
    n = _positive_int(cfg, "num_hidden_layers")
    top_k = _positive_int(cfg, keys.top_k)
    experts_key = next((k for k in keys.num_experts if cfg.get(k) is not None), keys.num_experts[-1])
    experts = _positive_int(cfg, experts_key)
    size = _positive_int(cfg, keys.intermediate_size)
    step = _positive_int(cfg, keys.sparse_step) if keys.sparse_step else 1
    dense = set(cfg.get(keys.dense_layers) or ()) if keys.dense_layers else set()
    layers = tuple(i for i in range(n) if i not in dense and (i + 1) % step == 0)
    if top_k > experts:
        raise AdapterValidationError(
            f"base model config: {keys.top_k} {top_k} exceeds the {experts} experts",
            field=keys.top_k,
        )
    return dict(num_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=size,
                moe_layers=layers)


def model_types_named(name: str | None) -> set[str]:
    """Model types the checkpoint name ``name`` points at by its last path component
    (``Qwen/Qwen3-8B`` → ``qwen3``); empty when it says nothing (``my-org/sql-model``)."""
    model = (name or "").rstrip("/").rsplit("/", 1)[-1]  # "mistralai/Mixtral-…": the model part
    if not model:
        return set()
    return {t for family in FAMILIES.values() for t, pattern in family.name_patterns
            if re.search(pattern, model, re.IGNORECASE)}


def folder_family(folder: Any) -> str | None:
    """``"<family> (<architecture>)"`` of the model folder's ``config.json`` (``qwen3
    (Qwen3ForCausalLM)``), or None when there is no readable, supported config there. For
    what ``/v1/models`` and the dashboard show."""
    import json
    from pathlib import Path

    try:
        config = json.loads((Path(folder) / "config.json").read_text())
        arch = resolve_architecture(config)
    except (OSError, ValueError, TypeError, AdapterValidationError):
        return None
    return f"{arch.family} ({arch.name})"


def family_mismatch(trained_on: str | None, dims: BaseModelDims, base_name: str | None) -> str | None:
    """Why ``trained_on`` (an adapter's ``base_model_name_or_path``) names a model of another
    architecture than the served base ``dims`` (named ``base_name``), or None: the same name,
    or a name that says nothing about its architecture (the shapes decide then)."""
    def last(name: str | None) -> str:
        return (name or "").rstrip("/").rsplit("/", 1)[-1].lower()

    if not trained_on or last(trained_on) == last(base_name):
        return None
    named = model_types_named(trained_on)
    if not named or dims.model_type in named or named & model_types_named(base_name):
        return None
    return (
        f"the adapter was trained on {trained_on!r}, a {'/'.join(sorted(named))} model; the base "
        f"model{f' {base_name!r}' if base_name else ''} is {dims.arch.name} "
        f"({dims.family.title}): an adapter only works on the base it was trained on"
    )
