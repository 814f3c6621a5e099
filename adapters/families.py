"""The model families loramux serves, one row each: a :class:`ModelFamily` says which Hugging
Face ``architectures`` it serves and where their tensors sit, what LoRA may target in it, how
its checkpoint names read, which config fields its experts have, and which engine module
builds its forward pass (a dotted path: this package never imports the engine).

The built-in rows are registered when this module is imported; :func:`register_family` adds
another (a plugin, a test) and :func:`unregister_family` takes it back. Everything else —
the upload validator (``adapters.arch``), the engine's model loader
(``engine.model.registry``) — reads :data:`FAMILIES` and :data:`ARCHITECTURES`, which these
two functions keep in step.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from loramux.adapters.projections import ATTENTION_MODULES, FUSED_MODULES, SUPPORTED_MODULES


@dataclass(frozen=True)
class Architecture:
    """One Hugging Face ``architectures`` entry the engine serves."""

    name: str
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
    family: str = ""
    """The name of the :class:`ModelFamily` whose row holds it (set by the row)."""


@dataclass(frozen=True)
class MoEKeys:
    """The config fields a mixture-of-experts family's experts are read from
    (``adapters.arch.moe_dims``)."""

    num_experts: tuple[str, ...]
    """Experts per MoE layer: the first of these fields the config sets."""
    intermediate_size: str
    """Each expert's intermediate size."""
    top_k: str = "num_experts_per_tok"
    """Experts each token is routed to."""
    sparse_step: str | None = None
    """Experts on the layers ``i`` with ``(i + 1) % step == 0`` (None: on every layer)."""
    dense_layers: str | None = None
    """Layers kept dense whatever the step says."""


@dataclass(frozen=True)
class ModelFamily:
    """One family: one row here and one engine module (``module``) that builds its forward
    pass from the Hugging Face config."""

    name: str
    title: str
    """How the docs and the dashboard name it."""
    module: str
    """Dotted path of the engine module with its ``decoder_spec(config) -> DecoderSpec``
    (imported by ``engine.model.registry`` when a model of the family loads)."""
    architectures: tuple[Architecture, ...]
    """The ``architectures`` entries it serves (each one's :attr:`Architecture.family` is
    set to this family's name)."""
    native_modules: tuple[str, ...]
    """The targetable projections as the family's checkpoints (and PEFT) name them."""
    mapped_modules: tuple[str, ...] = ()
    """Other spellings accepted and mapped onto the slices (split names on a fused family)."""
    moe: MoEKeys | None = None
    """The experts' config fields of a mixture-of-experts family (None: dense)."""
    name_patterns: tuple[tuple[str, str], ...] = ()
    """``(model_type, regex)``: what a checkpoint name (``Qwen/Qwen3-8B``) says about the model
    it names, matched case-insensitively against its last path component. A family may also
    name look-alikes it does not serve, so an adapter trained on one is told apart."""

    def __post_init__(self) -> None:
        rows = tuple(replace(a, family=self.name) for a in self.architectures)
        object.__setattr__(self, "architectures", rows)

    @property
    def lora_modules(self) -> tuple[str, ...]:
        """Every module name an adapter of this family may target."""
        return self.native_modules + self.mapped_modules

    @property
    def fused(self) -> bool:
        """Whether the checkpoints fuse q/k/v and gate/up."""
        return any(m in FUSED_MODULES for m in self.native_modules)


FAMILIES: dict[str, ModelFamily] = {}
"""Family name → its row, in registration order (the built-in ones first)."""
ARCHITECTURES: dict[str, Architecture] = {}
"""Hugging Face ``architectures`` entry → its row (of the family that serves it)."""


def register_family(family: ModelFamily) -> ModelFamily:
    """Serve ``family`` from now on: its architectures resolve to it, uploads validate against
    it and the engine builds it with its ``module``. Called for the built-in rows when this
    module is imported, and by whoever adds a family (before a model of it loads). Raises
    ``ValueError`` when its name or one of its architectures is taken, or a pattern is not a
    regular expression."""
    if not family.module or not family.architectures:
        raise ValueError(f"family {family.name!r} needs its engine module and architectures")
    if family.name in FAMILIES:
        raise ValueError(f"family {family.name!r} is already registered")
    taken = [a.name for a in family.architectures if a.name in ARCHITECTURES]
    if taken:
        raise ValueError(f"architectures {taken} are already served by another family")
    for _, pattern in family.name_patterns:
        re.compile(pattern)  # re.error is a ValueError
    FAMILIES[family.name] = family
    ARCHITECTURES.update({a.name: a for a in family.architectures})
    return family


def unregister_family(name: str) -> None:
    """Stop serving the family ``name`` (what :func:`register_family` added); models already
    loaded keep running. Raises ``KeyError`` for a family that is not registered."""
    family = FAMILIES.pop(name)
    for arch in family.architectures:
        ARCHITECTURES.pop(arch.name, None)


def family_of(arch: Architecture) -> ModelFamily:
    """The family serving ``arch``."""
    return FAMILIES[arch.family]


def architecture_of_model_type(model_type: str | None) -> Architecture | None:
    """The first architecture registered whose checkpoints' top-level ``model_type`` is
    ``model_type`` (a config without ``architectures``), or None."""
    return next((a for a in ARCHITECTURES.values()
                 if (a.config_model_type or a.model_type) == model_type), None)


def supported_model_types() -> tuple[str, ...]:
    """The text models' ``model_type`` values served, in registration order."""
    return tuple(dict.fromkeys(a.model_type for a in ARCHITECTURES.values()))


_FUSED_NATIVE = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
_GEMMA3_MM = Architecture(
    "Gemma3ForConditionalGeneration", "gemma3_text", config_model_type="gemma3",
    text_config="text_config", peft_prefix="model.language_model.",
    peft_prefix_aliases=("language_model.model.",),
    weight_prefixes=("language_model.model.", "model.language_model."),
    ignored_prefixes=("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
                      "model.multi_modal_projector."),
    ignored_modules=("out_proj", "fc1", "fc2", "mm_input_projection"),
)


def _engine(name: str) -> str:
    return f"loramux.engine.model.models.{name}"


for _family in (
    ModelFamily(
        "llama", "Llama / Mistral / Qwen2", _engine("llama"),
        (Architecture("LlamaForCausalLM", "llama"), Architecture("MistralForCausalLM", "mistral"),
         Architecture("Qwen2ForCausalLM", "qwen2")),
        SUPPORTED_MODULES,
        name_patterns=(("qwen2", r"qwen-?(?:2(?!-?vl|\.5-?vl|-?moe)|1\.5)|qwq"),
                       ("mistral", r"mistral|ministral"), ("llama", r"llama(?!-?4)")),
    ),
    ModelFamily(
        "qwen3", "Qwen3", _engine("qwen3"), (Architecture("Qwen3ForCausalLM", "qwen3"),),
        SUPPORTED_MODULES,
        name_patterns=(("qwen3", r"qwen-?3(?![.\d]|[-_]?(?:moe|next|vl|omni|asr))(?!.*-a\d+(?:\.\d+)?b)"),),
    ),
    ModelFamily(
        "gemma3", "Gemma 3 (text)", _engine("gemma3"),
        (Architecture("Gemma3ForCausalLM", "gemma3_text"), _GEMMA3_MM), SUPPORTED_MODULES,
        name_patterns=(("gemma3_text", r"gemma-?3(?!n)"),),
    ),
    ModelFamily(
        "gemma2", "Gemma 2", _engine("gemma2"), (Architecture("Gemma2ForCausalLM", "gemma2"),),
        SUPPORTED_MODULES, name_patterns=(("gemma2", r"gemma-?2"),),
    ),
    ModelFamily(
        "phi3", "Phi-3 / Phi-4", _engine("phi3"), (Architecture("Phi3ForCausalLM", "phi3"),),
        _FUSED_NATIVE, SUPPORTED_MODULES,
        # phi-1 / phi-2 (model type phi) are not served: named so their adapters are told apart
        name_patterns=(("phi3", r"phi-?(?:3|4)(?!-?(?:v|multimodal|small))"),
                       ("phi", r"phi-?(?:1|2)(?![\d.])")),
    ),
    # MoE: the experts are 3-D parameters, not modules; the dense MLP modules exist only in
    # Qwen3-MoE's dense layers (``mlp_only_layers`` / ``decoder_sparse_step``)
    ModelFamily(
        "qwen3_moe", "Qwen3-MoE", _engine("qwen3_moe"),
        (Architecture("Qwen3MoeForCausalLM", "qwen3_moe"),), SUPPORTED_MODULES,
        # config.json says num_experts; transformers' to_dict() the alias num_local_experts
        moe=MoEKeys(("num_experts", "num_local_experts"), "moe_intermediate_size",
                    sparse_step="decoder_sparse_step", dense_layers="mlp_only_layers"),
        name_patterns=(("qwen3_moe", r"qwen-?3(?:[-_]?moe|.*-a\d+(?:\.\d+)?b)"),),
    ),
    ModelFamily(
        "mixtral", "Mixtral", _engine("mixtral"), (Architecture("MixtralForCausalLM", "mixtral"),),
        ATTENTION_MODULES,
        moe=MoEKeys(("num_local_experts",), "intermediate_size"),  # experts on every layer
        name_patterns=(("mixtral", r"mixtral"),),
    ),
):
    register_family(_family)
