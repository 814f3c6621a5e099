"""The projections of a decoder layer, by name: the split names every family has, the fused
checkpoint names some families use, the engine's projection groups, and where a LoRA tensor
of each sits in PEFT's saved names.

Every family's projections are described with the seven split names
(:data:`SUPPORTED_MODULES`: ``q_proj`` … ``down_proj``), which is also the engine's slot
layout (:data:`PROJECTION_GROUPS`). Checkpoints that fuse them (Phi-3's ``qkv_proj`` and
``gate_up_proj``, :data:`FUSED_MODULES`) have adapters on the fused names; such a LoRA maps
onto the slices (one A shared by the slices, B split by rows). Re-exported by
:mod:`~loramux.adapters.arch`, where the rest of the package imports them from.
"""

from __future__ import annotations

import re

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
    (:attr:`~loramux.adapters.families.Architecture.peft_prefix`)."""
    tail = "lora_magnitude_vector" if which == "M" else f"lora_{which}.weight"
    return f"base_model.model.{prefix}layers.{layer}.{MODULE_PARENT[module]}.{module}.{tail}"
