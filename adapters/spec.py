"""``adapter_config.json`` → :class:`LoraSpec`: PEFT's LoRA config read (size-capped),
checked field by field (refusing features that change the math) and normalized.

The weights' side of the format (reading, checking against a base model, saving) is in
:mod:`~loramux.adapters.format`.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loramux.adapters.alora import parse_invocation
from loramux.adapters.arch import (
    FUSED_MODULES,
    LORA_MODULES,
    MODULE_PARENT,
    SUPPORTED_MODULES,
    BaseModelDims,
)
from loramux.adapters.archive import CONFIG_NAME
from loramux.adapters.errors import AdapterValidationError, pickle_refusal
from loramux.adapters.experts import parameter_ranks, parse_target_parameters
from loramux.adapters.kinds import adapter_kind
from loramux.adapters.limits import DEFAULT_MAX_LORA_RANK
from loramux.adapters.safetensors_io import looks_like_pickle
from loramux.adapters.saved_modules import parse_modules_to_save
from loramux.adapters.vocab import (
    check_vocab_combination,
    parse_trainable_tokens,
    split_vocab_targets,
)

__all__ = [
    "DEFAULT_MAX_LORA_RANK",
    "MAX_CONFIG_BYTES",
    "MAX_LAYER_INDEX",
    "LoraSpec",
    "parse_config",
    "read_config",
    "refuse",
]

MAX_CONFIG_BYTES = 1024 * 1024
MAX_LAYER_INDEX = 4096

# Config fields that change the math or the model structure; refused when set.
_REFUSED_FEATURES = {
    "lora_bias": "lora_bias (a trained bias on lora_B) is not supported",
    "layer_replication": "layer_replication is not supported",
    "exclude_modules": "exclude_modules is not supported; list the modules in target_modules",
    "use_qalora": "QA-LoRA (use_qalora) is not supported",
    "arrow_config": "Arrow routing (arrow_config) is not supported",
    "kasa_config": "KaSA (kasa_config) is not supported",
    "use_bdlora": "block-diagonal LoRA (use_bdlora) is not supported",
    "monteclora_config": "MonteCLoRA (monteclora_config) is not supported",
    "megatron_config": "Megatron-parallel LoRA (megatron_config) is not supported",
    "velora_config": "VeLoRA (velora_config) is not supported",
}


@dataclass(frozen=True)
class LoraSpec:
    """What ``adapter_config.json`` says, normalized.

    ``target_modules`` holds canonical module names (``"q_proj"`` …) in the order of
    :data:`~loramux.adapters.arch.LORA_MODULES` (split names, then fused ones such as
    ``qkv_proj``, as the adapter names them): every module that has LoRA in some
    layer. ``layers_to_transform`` is ``None`` for every layer. ``module_layers`` lists
    ``(layer, module)`` pairs for modules that PEFT targeted by full path in single layers
    (``model.layers.0.self_attn.q_proj``, as it writes for ``all-linear`` on some
    models); a module without pairs there is targeted in every layer (of
    ``layers_to_transform``). Use :meth:`targets` rather than reading these directly.
    ``use_dora``: a DoRA adapter (weight-decomposed LoRA: a learned magnitude per output
    feature of every targeted module, ``lora_magnitude_vector``; see
    :attr:`LoraWeights.magnitudes`). ``fan_in_fan_out`` is kept as written, but the tensors in
    :class:`LoraWeights` are always in PEFT's ``nn.Linear`` orientation (PEFT itself
    ignores the flag for ``nn.Linear`` layers, which is all every served family has).
    """

    r: int
    lora_alpha: float
    target_modules: tuple[str, ...]
    use_rslora: bool = False
    fan_in_fan_out: bool = False
    base_model_name_or_path: str | None = None
    layers_to_transform: tuple[int, ...] | None = None
    module_layers: tuple[tuple[int, str], ...] = ()
    target_parameters: tuple[str, ...] = ()
    """Expert parameters with LoRA (``gate_up_proj``, ``down_proj``; ``adapters/experts.py``),
    in every MoE layer."""
    parameter_ranks: tuple[tuple[str, int, float], ...] = ()
    """``(parameter, rank, alpha)`` of each of :attr:`target_parameters`."""

    def expert_rank(self, param: str) -> int:
        """The rank of the experts' LoRA on ``param``."""
        return next(r for p, r, _ in self.parameter_ranks if p == param)

    def expert_scale(self, param: str) -> float:
        """The factor on ``B_e @ A_e`` of the experts' LoRA on ``param``."""
        r, alpha = next((r, a) for p, r, a in self.parameter_ranks if p == param)
        return alpha / (math.sqrt(r) if self.use_rslora else r)

    @property
    def max_rank(self) -> int:
        """The largest rank of any of its LoRAs (what a slot must hold)."""
        return max([self.r if self.target_modules or self.vocab_modules or self.trainable_tokens else 0,
                    *(r for _, r, _ in self.parameter_ranks)])
    use_dora: bool = False
    alora_invocation_tokens: tuple[int, ...] | None = None
    """An activated LoRA's invocation token ids (``adapters/alora.py``; None: a plain LoRA)."""
    vocab_modules: tuple[str, ...] = ()
    """``embed_tokens`` / ``lm_head`` when the adapter has LoRA on them (``adapters/vocab.py``)."""
    trainable_tokens: tuple[tuple[str, tuple[int, ...]], ...] = ()
    """``(module, token ids)`` of its trainable tokens (``trainable_token_indices``)."""
    ensure_weight_tying: bool = False
    """PEFT's flag: an ``embed_tokens`` LoRA comes with the tied ``lm_head``'s (saved as such)."""
    modules_to_save: tuple[str, ...] = ()
    """Module-name suffixes whose whole copies the adapter ships (``adapters/saved_modules.py``)."""

    @property
    def kind(self) -> str:
        """What the API and the dashboard call this adapter (``adapters/kinds.py``)."""
        return adapter_kind(self.to_config())

    def targets(self, layer: int, module: str) -> bool:
        """Whether ``module`` of decoder layer ``layer`` carries this LoRA."""
        if module not in self.target_modules:
            return False
        pairs = [p for p in self.module_layers if p[1] == module]
        if pairs:
            return (layer, module) in pairs
        return self.layers_to_transform is None or layer in self.layers_to_transform

    @property
    def scale(self) -> float:
        """The factor on ``B @ A``: ``alpha / sqrt(r)`` with rsLoRA, else ``alpha / r``."""
        return self.lora_alpha / (math.sqrt(self.r) if self.use_rslora else self.r)

    def to_config(self, prefix: str = "model.") -> dict[str, Any]:
        """A PEFT ``adapter_config.json`` dict for this spec (``prefix``: where the decoder's
        layers sit, :attr:`~loramux.adapters.arch.Architecture.peft_prefix`)."""
        return {
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "r": self.r,
            "lora_alpha": self.lora_alpha,
            "target_modules": [
                *(m for m in self.target_modules if all(p[1] != m for p in self.module_layers)),
                *(f"{prefix}layers.{i}.{MODULE_PARENT[m]}.{m}" for i, m in self.module_layers),
                *self.vocab_modules,
            ] or None,
            **({"ensure_weight_tying": True} if self.ensure_weight_tying else {}),
            **({"trainable_token_indices": {m: list(ids) for m, ids in self.trainable_tokens}}
               if self.trainable_tokens else {}),
            "use_rslora": self.use_rslora,
            "fan_in_fan_out": self.fan_in_fan_out,
            "bias": "none",
            "lora_dropout": 0.0,
            "base_model_name_or_path": self.base_model_name_or_path,
            "layers_to_transform": (
                list(self.layers_to_transform) if self.layers_to_transform is not None else None
            ),
            "use_dora": self.use_dora,
            **({"alora_invocation_tokens": list(self.alora_invocation_tokens)}
               if self.alora_invocation_tokens is not None else {}),
            "modules_to_save": list(self.modules_to_save) or None,
            "inference_mode": True,
            **({"target_parameters": [f"mlp.experts.{p}" if p != "router" else "mlp.gate.weight"
                                      for p in self.target_parameters],
                "rank_pattern": {f".*\\.{p}": r for p, r, _ in self.parameter_ranks if r != self.r},
                "alpha_pattern": {f".*\\.{p}": a for p, _, a in self.parameter_ranks
                                  if a != self.lora_alpha}}
               if self.target_parameters else {}),
        }


def refuse(field_name: str, message: str) -> AdapterValidationError:
    return AdapterValidationError(f"{field_name}: {message}", field=field_name)


def read_config(path: str | os.PathLike) -> dict[str, Any]:
    """Read and parse ``adapter_config.json`` (size-capped; JSON object required)."""
    path = Path(path)
    if not path.is_file():
        raise refuse(CONFIG_NAME, "missing; an adapter needs adapter_config.json")
    size = path.stat().st_size
    if size == 0:
        raise refuse(CONFIG_NAME, "the file is empty")
    if size > MAX_CONFIG_BYTES:
        raise refuse(CONFIG_NAME, f"{size} bytes, above the {MAX_CONFIG_BYTES}-byte limit")
    raw = path.read_bytes()
    try:
        config = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        if looks_like_pickle(raw[:8]):
            raise pickle_refusal(CONFIG_NAME) from None
        raise refuse(CONFIG_NAME, f"invalid JSON ({e})") from None
    if not isinstance(config, dict):
        raise refuse(CONFIG_NAME, "expected a JSON object")
    return config


_TARGET_RE = re.compile(
    r"^(?:(?P<full>model\.language_model\.|language_model\.model\.|model\.)?layers\.(?P<layer>\d{1,6})\.)?"
    r"(?:(?P<parent>self_attn|mlp)\.)?(?P<module>[A-Za-z0-9_]+)$"
)
_NON_TEXT_TARGET_RE = re.compile(r"^(?:model\.)?(?:vision_tower|vision_model|multi_modal_projector)\.")


def _parse_target(entry: Any, accepted: tuple[str, ...]) -> tuple[str, int | None, bool]:
    """``(module, layer or None, exact)`` for one ``target_modules`` entry."""
    supported = ", ".join(accepted)
    if not isinstance(entry, str) or not entry:
        raise refuse("target_modules", f"entries must be module names, got {entry!r}")
    m = _TARGET_RE.match(entry)
    module = m["module"] if m else entry.rsplit(".", 1)[-1]
    if module not in accepted:
        hint = ""
        if module in ("w1", "w2", "w3") or ".experts." in entry:
            hint = (" (per-expert LoRA modules of a transformers 4 MoE checkpoint: load the adapter with "
                    "PEFT >= 0.17 onto the transformers 5 model and save it again, which writes "
                    "target_parameters on mlp.experts.gate_up_proj / down_proj)")
        elif module in LORA_MODULES:
            hint = (" (a fused checkpoint's name, as Phi-3 has: the adapter was trained for another "
                    "family)" if module in FUSED_MODULES else
                    " (this family's checkpoints fuse it: target the fused module)")
        raise refuse(
            "target_modules",
            f"{entry!r} is not a supported target module of this base model{hint}; supported: "
            f"{supported}",
        )
    if m is None or (m["parent"] and m["parent"] != MODULE_PARENT[module]):
        raise refuse(
            "target_modules",
            f"{entry!r}: expected a module name such as {module!r} or a path such as "
            f"'model.layers.0.{MODULE_PARENT[module]}.{module}'",
        )
    if m["layer"] is not None and not m["parent"]:
        raise refuse(
            "target_modules",
            f"{entry!r} names no module of the model; expected "
            f"'model.layers.{m['layer']}.{MODULE_PARENT[module]}.{module}'",
        )
    layer = int(m["layer"]) if m["layer"] is not None else None
    if layer is not None and layer >= MAX_LAYER_INDEX:
        raise refuse("target_modules", f"{entry!r}: layer index out of range")
    return module, layer, bool(m["full"])


def _parse_targets(
    value: Any, layers: tuple[int, ...] | None, base: BaseModelDims | None
) -> tuple[tuple[str, ...], tuple[tuple[int, str], ...]]:
    """``(target_modules, module_layers)`` from the config's ``target_modules``: the names
    ``base``'s family accepts (any family's without a base); a multimodal base's vision-tower
    targets are left out (it is served text-only)."""
    accepted = base.family.lora_modules if base is not None else LORA_MODULES
    native = base.family.native_modules if base is not None else SUPPORTED_MODULES
    ignored = base.arch.ignored_modules if base is not None else ()
    if value is None:
        raise refuse("target_modules", "missing; expected a list of module names")
    if isinstance(value, str):
        if value == "all-linear":
            return tuple(m for m in LORA_MODULES if m in native), ()
        if value in accepted:
            return (value,), ()
        raise refuse(
            "target_modules",
            f"regular expressions ({value!r}) are not accepted; list the module names "
            f"(supported: {', '.join(accepted)}) or use 'all-linear'",
        )
    if not isinstance(value, list | tuple) or not value:
        raise refuse("target_modules", f"expected a non-empty list of module names, got {value!r}")
    everywhere: set[str] = set()
    pairs: set[tuple[int, str]] = set()
    for entry in value:
        if ignored and isinstance(entry, str) and (
            entry in ignored or _NON_TEXT_TARGET_RE.match(entry)
        ):
            continue
        module, layer, exact = _parse_target(entry, accepted)
        if layer is None:
            everywhere.add(module)
        elif exact or layers is None or layer in layers:
            # PEFT applies layers_to_transform to suffix matches, not to exact module paths.
            pairs.add((layer, module))
    pairs = {p for p in pairs if p[1] not in everywhere}
    modules = everywhere | {m for _, m in pairs}
    if not modules:
        raise refuse("target_modules", "targets no module of the text model")
    for fused, parts in FUSED_MODULES.items():
        both = [p for p in parts if p in modules]
        if fused in modules and both:
            raise refuse(
                "target_modules",
                f"{fused!r} and {both[0]!r} both target the same projection (fused and split "
                f"names in one adapter cannot be mapped onto one base model)",
            )
    return tuple(m for m in LORA_MODULES if m in modules), tuple(sorted(pairs))


def _parse_layers(config: Mapping[str, Any]) -> tuple[int, ...] | None:
    value = config.get("layers_to_transform")
    pattern = config.get("layers_pattern")
    if pattern not in (None, "", "layers", [], ["layers"]):
        raise refuse(
            "layers_pattern", f"expected 'layers' (every served family's decoder layers), got {pattern!r}"
        )
    if value is None or value == []:
        return None
    if isinstance(value, int) and not isinstance(value, bool):
        value = [value]
    if not isinstance(value, list) or not all(
        isinstance(i, int) and not isinstance(i, bool) and 0 <= i < MAX_LAYER_INDEX for i in value
    ):
        raise refuse("layers_to_transform", f"expected layer indices, got {value!r}")
    return tuple(sorted(set(value)))


def _bool(config: Mapping[str, Any], key: str) -> bool:
    value = config.get(key, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise refuse(key, f"expected true or false, got {value!r}")
    return value


def parse_config(config: Mapping[str, Any], served: BaseModelDims | None = None) -> LoraSpec:
    """Turn an ``adapter_config.json`` dict into a :class:`LoraSpec`, refusing what is
    unsupported. With ``served`` (the served base model) the target modules must be those its
    family accepts, and ``all-linear`` means its projections."""
    peft_type = config.get("peft_type")
    if peft_type != "LORA":
        raise refuse("peft_type", f"expected 'LORA', got {peft_type!r}")
    for key, why in _REFUSED_FEATURES.items():
        if config.get(key):
            raise refuse(key, why)
    bias = config.get("bias", "none")
    if bias != "none":
        raise refuse("bias", f"trained biases are not supported; expected 'none', got {bias!r}")
    params = parse_target_parameters(config, served)
    if params and _bool(config, "use_dora"):
        raise refuse("use_dora", "DoRA on expert parameters (target_parameters) is not supported; "
                     "PEFT's DoRA covers linear modules only")
    if not params:
        for key in ("rank_pattern", "alpha_pattern"):
            if config.get(key):
                raise refuse(key, "per-module ranks or alphas are not supported; expected {}")
    r = config.get("r")
    if isinstance(r, bool) or not isinstance(r, int) or r <= 0:
        raise refuse("r", f"expected a positive integer rank, got {r!r}")
    alpha = config.get("lora_alpha", 8)
    if (
        isinstance(alpha, bool)
        or not isinstance(alpha, int | float)
        or not math.isfinite(alpha)
        or alpha <= 0
    ):
        raise refuse("lora_alpha", f"expected a positive number, got {alpha!r}")
    base = config.get("base_model_name_or_path")
    if base is not None and not isinstance(base, str):
        raise refuse("base_model_name_or_path", f"expected a string, got {base!r}")
    layers = _parse_layers(config)
    target_value, vocab_modules = split_vocab_targets(config.get("target_modules"))
    tokens = parse_trainable_tokens(config.get("trainable_token_indices"),
                                    getattr(served, "vocab_size", None), vocab_modules)
    if (params or vocab_modules or tokens) and target_value in (None, []):
        targets, module_layers = (), ()
    else:
        targets, module_layers = _parse_targets(target_value, layers, served)
    check_vocab_combination(config, vocab_modules, tokens)
    return LoraSpec(
        r=r,
        lora_alpha=float(alpha),
        target_modules=targets,
        use_rslora=_bool(config, "use_rslora"),
        fan_in_fan_out=_bool(config, "fan_in_fan_out"),
        base_model_name_or_path=base or None,
        layers_to_transform=layers,
        module_layers=module_layers,
        target_parameters=params,
        parameter_ranks=parameter_ranks(config, params, r, float(alpha)),
        use_dora=_bool(config, "use_dora"),
        alora_invocation_tokens=parse_invocation(config, getattr(served, "vocab_size", None)),
        vocab_modules=vocab_modules,
        trainable_tokens=tokens,
        ensure_weight_tying=_bool(config, "ensure_weight_tying"),
        modules_to_save=parse_modules_to_save(config.get("modules_to_save")),
    )

