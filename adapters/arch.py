"""The one description of the supported base models: their families, the Hugging Face
``architectures`` each family serves, the projections LoRA may target in each, and the
shapes those imply. The adapter validator checks uploads against it; the engine
(``engine.model.registry``) builds the forward pass of the family it names, and its slots
from the shapes (``engine.model.weights.ModelDims`` extends :class:`BaseModelDims`).

Module names. Every family's projections are described with the seven split names
(:data:`SUPPORTED_MODULES`: ``q_proj`` … ``down_proj``), which is also the engine's slot
layout (:data:`PROJECTION_GROUPS`). Checkpoints that fuse them (Phi-3's ``qkv_proj`` and
``gate_up_proj``, :data:`FUSED_MODULES`) have adapters on the fused names; such a LoRA maps
onto the slices (one A shared by the slices, B split by rows).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from loramux.adapters.errors import AdapterValidationError

ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
SUPPORTED_MODULES = ATTENTION_MODULES + MLP_MODULES
"""The split projections every family has (the names of split checkpoints)."""
FUSED_MODULES: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}
"""Fused checkpoint projections → the split projections they hold, in row order."""
LORA_MODULES = SUPPORTED_MODULES + tuple(FUSED_MODULES)
"""Every module name an adapter may target in some family."""
MODULE_PARENT = {
    **{m: "self_attn" for m in (*ATTENTION_MODULES, "qkv_proj")},
    **{m: "mlp" for m in (*MLP_MODULES, "gate_up_proj")},
}

PROJECTION_GROUPS: dict[str, tuple[str, ...]] = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}
"""The engine's projection groups (one matmul and one LoRA hook call each per layer), with
the split modules fused into each, in column order."""
GROUP_FUSED_MODULE = {"qkv": "qkv_proj", "gate_up": "gate_up_proj"}
"""The fused checkpoint name of a group (a LoRA on it covers every slice of the group)."""
GROUP_OF = {m: g for g, ms in PROJECTION_GROUPS.items() for m in ms} | {
    f: g for g, f in GROUP_FUSED_MODULE.items()
}

# base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight; a multimodal checkpoint
# served text-only puts its decoder under model.language_model (or language_model.model).
TENSOR_KEY_RE = re.compile(
    r"^base_model\.model\.(?P<prefix>model\.language_model\.|language_model\.model\.|model\.)"
    r"layers\.(?P<layer>\d{1,6})\.(?P<parent>self_attn|mlp)\."
    r"(?P<module>[A-Za-z0-9_]+)\.(?:lora_(?P<which>[AB])\.weight|"
    r"(?P<magnitude>lora_magnitude_vector)(?:\.weight)?)$"
)
"""One LoRA tensor of the decoder: A, B or (DoRA) the magnitude vector, which PEFT saves as
``….lora_magnitude_vector`` (``.weight`` appended by some versions)."""
NON_TEXT_KEY_RE = re.compile(
    r"^base_model\.model\.(?:model\.)?(?:vision_tower|vision_model|multi_modal_projector)\."
    r"[A-Za-z0-9_.]+\.(?:lora_[AB]\.weight|lora_magnitude_vector(?:\.weight)?)$"
)
"""LoRA tensors of a multimodal checkpoint's vision tower: kept for export, not served."""


def tensor_key(layer: int, module: str, which: str, prefix: str = "model.") -> str:
    """PEFT's saved name for one LoRA tensor (``which`` is ``"A"``, ``"B"`` or ``"M"``, DoRA's
    magnitude vector); ``prefix`` is where the family's decoder sits
    (:attr:`Architecture.peft_prefix`)."""
    tail = "lora_magnitude_vector" if which == "M" else f"lora_{which}.weight"
    return f"base_model.model.{prefix}layers.{layer}.{MODULE_PARENT[module]}.{module}.{tail}"


@dataclass(frozen=True)
class ModelFamily:
    """One forward pass of the engine (``engine/model/models/<name>.py``) and what LoRA may
    target in it."""

    name: str
    title: str
    """How the docs and the dashboard name it."""
    native_modules: tuple[str, ...]
    """The targetable projections as the family's checkpoints (and PEFT) name them."""
    mapped_modules: tuple[str, ...] = ()
    """Other spellings accepted and mapped onto the slices (split names on a fused family)."""
    moe: bool = False
    """Mixture-of-experts layers (``BaseModelDims.num_experts`` …; ``engine/model/moe.py``)."""

    @property
    def lora_modules(self) -> tuple[str, ...]:
        """Every module name an adapter of this family may target."""
        return self.native_modules + self.mapped_modules

    @property
    def fused(self) -> bool:
        """Whether the checkpoints fuse q/k/v and gate/up."""
        return any(m in FUSED_MODULES for m in self.native_modules)


_FUSED_NATIVE = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
FAMILIES: dict[str, ModelFamily] = {
    f.name: f
    for f in (
        ModelFamily("llama", "Llama / Mistral / Qwen2", SUPPORTED_MODULES),
        ModelFamily("qwen3", "Qwen3", SUPPORTED_MODULES),
        ModelFamily("gemma3", "Gemma 3 (text)", SUPPORTED_MODULES),
        ModelFamily("gemma2", "Gemma 2", SUPPORTED_MODULES),
        ModelFamily("phi3", "Phi-3 / Phi-4", _FUSED_NATIVE, SUPPORTED_MODULES),
        # MoE: the experts are 3-D parameters, not modules; the dense MLP modules exist only in
        # Qwen3-MoE's dense layers (``mlp_only_layers`` / ``decoder_sparse_step``)
        ModelFamily("qwen3_moe", "Qwen3-MoE", SUPPORTED_MODULES, moe=True),
        ModelFamily("mixtral", "Mixtral", ATTENTION_MODULES, moe=True),
    )
}


@dataclass(frozen=True)
class Architecture:
    """One Hugging Face ``architectures`` entry the engine serves."""

    name: str
    family: str
    model_type: str
    """``model_type`` of the text model (of ``text_config`` for multimodal checkpoints)."""
    config_model_type: str | None = None
    """``model_type`` of the checkpoint's top-level config when it differs (multimodal)."""
    text_config: str | None = None
    """Key of the nested text-model config (multimodal checkpoints served text-only)."""
    peft_prefix: str = "model."
    """Where the decoder's ``layers`` sit in the model PEFT wraps (tensor names, paths)."""
    peft_prefix_aliases: tuple[str, ...] = ()
    """Older spellings of :attr:`peft_prefix` that adapters in the wild use."""
    weight_prefixes: tuple[str, ...] = ("model.",)
    """Where the decoder's tensors sit in checkpoints (first match wins)."""
    ignored_prefixes: tuple[str, ...] = ()
    """Checkpoint tensors the text model does not use (a vision tower)."""
    ignored_modules: tuple[str, ...] = ()
    """Linear layers only the unused parts have (``target_modules`` naming them is fine: a
    LoRA there is kept for export and not served)."""


_GEMMA3_MM_WEIGHTS = ("language_model.model.", "model.language_model.")
ARCHITECTURES: dict[str, Architecture] = {
    a.name: a
    for a in (
        Architecture("LlamaForCausalLM", "llama", "llama"),
        Architecture("MistralForCausalLM", "llama", "mistral"),
        Architecture("Qwen2ForCausalLM", "llama", "qwen2"),
        Architecture("Qwen3ForCausalLM", "qwen3", "qwen3"),
        Architecture("Gemma3ForCausalLM", "gemma3", "gemma3_text"),
        Architecture(
            "Gemma3ForConditionalGeneration", "gemma3", "gemma3_text", config_model_type="gemma3",
            text_config="text_config", peft_prefix="model.language_model.",
            peft_prefix_aliases=("language_model.model.",),
            weight_prefixes=_GEMMA3_MM_WEIGHTS,
            ignored_prefixes=("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
                              "model.multi_modal_projector."),
            ignored_modules=("out_proj", "fc1", "fc2", "mm_input_projection"),
        ),
        Architecture("Gemma2ForCausalLM", "gemma2", "gemma2"),
        Architecture("Phi3ForCausalLM", "phi3", "phi3"),
        Architecture("Qwen3MoeForCausalLM", "qwen3_moe", "qwen3_moe"),
        Architecture("MixtralForCausalLM", "mixtral", "mixtral"),
    )
}
SUPPORTED_ARCHITECTURES = {a.name: a.model_type for a in ARCHITECTURES.values()}
"""Hugging Face ``architectures`` entries → ``model_type`` of the text model."""
SUPPORTED_MODEL_TYPES = tuple(dict.fromkeys(SUPPORTED_ARCHITECTURES.values()))
_BY_MODEL_TYPE = {}
for _a in ARCHITECTURES.values():
    _BY_MODEL_TYPE.setdefault(_a.config_model_type or _a.model_type, _a)


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
        arch = _BY_MODEL_TYPE.get(model_type)
    if arch is not None and model_type not in (None, arch.config_model_type or arch.model_type):
        names, arch = [], None  # e.g. architectures says Llama, model_type says gpt2
    if arch is None:
        what = f"architecture {names!r}" if names else f"base model type {model_type!r}"
        raise AdapterValidationError(
            f"{what} is not supported; loramux serves {supported_summary()} "
            f"(model types {', '.join(SUPPORTED_MODEL_TYPES)})",
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
        return FAMILIES[self.arch.family]

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
    """The experts' dimensions of an MoE config (empty for a dense family): Mixtral's
    ``num_local_experts`` experts of ``intermediate_size`` on every layer; Qwen3-MoE's
    ``num_experts`` of ``moe_intermediate_size`` on the layers ``decoder_sparse_step`` picks
    and ``mlp_only_layers`` leaves dense, as transformers builds them."""
    if not FAMILIES[arch.family].moe:
        return {}
    n = _positive_int(cfg, "num_hidden_layers")
    top_k = _positive_int(cfg, "num_experts_per_tok")
    if arch.family == "mixtral":
        experts = _positive_int(cfg, "num_local_experts")  # transformers' alias: num_experts
        size = _positive_int(cfg, "intermediate_size")
        layers = tuple(range(n))
    else:
        key = "num_experts" if cfg.get("num_experts") is not None else "num_local_experts"
        experts = _positive_int(cfg, key)  # config.json: num_experts; transformers' dict: the alias
        size = _positive_int(cfg, "moe_intermediate_size")
        step = _positive_int(cfg, "decoder_sparse_step")
        dense = set(cfg.get("mlp_only_layers") or ())
        layers = tuple(i for i in range(n) if i not in dense and (i + 1) % step == 0)
    if top_k > experts:
        raise AdapterValidationError(
            f"base model config: num_experts_per_tok {top_k} exceeds the {experts} experts",
            field="num_experts_per_tok",
        )
    return dict(num_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=size,
                moe_layers=layers)


# What a name says about the model it names (``base_model_name_or_path``): the model types
# of well-known checkpoint names. A name that matches none says nothing.
_NAME_PATTERNS: tuple[tuple[str, re.Pattern], ...] = tuple(
    (t, re.compile(p, re.IGNORECASE))
    for t, p in (
        ("qwen3", r"qwen-?3(?![.\d]|[-_]?(?:moe|next|vl|omni|asr))(?!.*-a\d+(?:\.\d+)?b)"),
        ("qwen3_moe", r"qwen-?3(?:[-_]?moe|.*-a\d+(?:\.\d+)?b)"),
        ("qwen2", r"qwen-?(?:2(?!-?vl|\.5-?vl|-?moe)|1\.5)|qwq"),
        ("gemma3_text", r"gemma-?3(?!n)"),
        ("gemma2", r"gemma-?2"),
        ("phi3", r"phi-?(?:3|4)(?!-?(?:v|multimodal|small))"),
        ("phi", r"phi-?(?:1|2)(?![\d.])"),
        ("mixtral", r"mixtral"),
        ("mistral", r"mistral|ministral"),
        ("llama", r"llama(?!-?4)"),
    )
)


def model_types_named(name: str | None) -> set[str]:
    """Model types the checkpoint name ``name`` points at by its last path component
    (``Qwen/Qwen3-8B`` → ``qwen3``); empty when it says nothing (``my-org/sql-model``)."""
    model = (name or "").rstrip("/").rsplit("/", 1)[-1]  # "mistralai/Mixtral-…": the model part
    if not model:
        return set()
    return {t for t, p in _NAME_PATTERNS if p.search(model)}


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
