"""The PEFT LoRA adapter format: parse, check, load.

An adapter is a folder (or one ``.tar.gz`` / ``.zip`` archive of it) holding
``adapter_config.json`` and ``adapter_model.safetensors`` with PEFT's tensor names::

    base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight   # [r, in_features]
    base_model.model.model.layers.{i}.mlp.down_proj.lora_B.weight      # [out_features, r]

:func:`load_adapter` reads one with no base-model checks (the engine calls it on adapters
the registry has already validated); :func:`validate_adapter` runs every check against a
base model config (the registry calls it on upload). Safetensors only: nothing here calls
``torch.load`` or unpickles anything.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from loramux.adapters.arch import (
    MODULE_PARENT,
    SUPPORTED_MODULES,
    TENSOR_KEY_RE,
    BaseModelDims,
    base_dims,
    tensor_key,
)
from loramux.adapters.archive import (
    CONFIG_NAME,
    WEIGHTS_NAME,
    adapter_folder,
)
from loramux.adapters.errors import AdapterValidationError, pickle_refusal
from loramux.adapters.safetensors_io import (
    FLOAT_DTYPES,
    TensorInfo,
    load_tensors,
    looks_like_pickle,
    read_header,
)

__all__ = [
    "DEFAULT_MAX_ADAPTER_BYTES",
    "DEFAULT_MAX_LORA_RANK",
    "AdapterValidationError",
    "LoraSpec",
    "LoraWeights",
    "load_adapter",
    "parse_config",
    "read_config",
    "save_adapter",
    "validate_adapter",
]

logger = logging.getLogger(__name__)

DEFAULT_MAX_LORA_RANK = 16
"""The largest rank served and accepted when nothing says otherwise (``--max-lora-rank``);
the engine's ``LoRAConfig`` and the registry use this one default."""
DEFAULT_MAX_ADAPTER_BYTES = 1024**3
MAX_CONFIG_BYTES = 1024 * 1024
MAX_LAYER_INDEX = 4096

# Config fields that change the math or the model structure; refused when set.
_REFUSED_FEATURES = {
    "use_dora": "DoRA (use_dora) is not supported; train a plain LoRA adapter",
    "modules_to_save": "modules_to_save is not supported: the adapter may only add LoRA "
    "weights, not replace whole base modules",
    "lora_bias": "lora_bias (a trained bias on lora_B) is not supported",
    "trainable_token_indices": "trainable_token_indices (trained embedding rows) is not supported",
    "layer_replication": "layer_replication is not supported",
    "target_parameters": "target_parameters (LoRA on raw parameters) is not supported",
    "exclude_modules": "exclude_modules is not supported; list the modules in target_modules",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens) is not supported",
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
    :data:`~loramux.adapters.arch.SUPPORTED_MODULES`: every module that has LoRA in some
    layer. ``layers_to_transform`` is ``None`` for every layer. ``module_layers`` lists
    ``(layer, module)`` pairs for modules that PEFT targeted by full path in single layers
    (``model.layers.0.self_attn.q_proj``, as it writes for ``all-linear`` on some
    models); a module without pairs there is targeted in every layer (of
    ``layers_to_transform``). Use :meth:`targets` rather than reading these directly.
    ``fan_in_fan_out`` is kept as written, but the tensors in
    :class:`LoraWeights` are always in PEFT's ``nn.Linear`` orientation (PEFT itself
    ignores the flag for ``nn.Linear`` layers, which is all a Llama-family model has).
    """

    r: int
    lora_alpha: float
    target_modules: tuple[str, ...]
    use_rslora: bool = False
    fan_in_fan_out: bool = False
    base_model_name_or_path: str | None = None
    layers_to_transform: tuple[int, ...] | None = None
    module_layers: tuple[tuple[int, str], ...] = ()

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

    def to_config(self) -> dict[str, Any]:
        """A PEFT ``adapter_config.json`` dict for this spec."""
        return {
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "r": self.r,
            "lora_alpha": self.lora_alpha,
            "target_modules": [
                *(m for m in self.target_modules if all(p[1] != m for p in self.module_layers)),
                *(f"model.layers.{i}.{MODULE_PARENT[m]}.{m}" for i, m in self.module_layers),
            ],
            "use_rslora": self.use_rslora,
            "fan_in_fan_out": self.fan_in_fan_out,
            "bias": "none",
            "lora_dropout": 0.0,
            "base_model_name_or_path": self.base_model_name_or_path,
            "layers_to_transform": (
                list(self.layers_to_transform) if self.layers_to_transform is not None else None
            ),
            "use_dora": False,
            "modules_to_save": None,
            "inference_mode": True,
        }


@dataclass
class LoraWeights:
    """A loaded adapter.

    ``layers[i][module] = (A, B)`` with A ``[r, in_features]`` and B ``[out_features, r]``;
    a layer or module without tensors has no LoRA. ``warnings`` carries what validation
    noticed but accepted (a different ``base_model_name_or_path``).
    """

    spec: LoraSpec
    layers: dict[int, dict[str, tuple[torch.Tensor, torch.Tensor]]]
    warnings: list[str] = field(default_factory=list)

    def num_bytes(self) -> int:
        """Bytes held by all A and B tensors."""
        return sum(
            a.numel() * a.element_size() + b.numel() * b.element_size()
            for modules in self.layers.values()
            for a, b in modules.values()
        )


def _refuse(field_name: str, message: str) -> AdapterValidationError:
    return AdapterValidationError(f"{field_name}: {message}", field=field_name)


def read_config(path: str | os.PathLike) -> dict[str, Any]:
    """Read and parse ``adapter_config.json`` (size-capped; JSON object required)."""
    path = Path(path)
    if not path.is_file():
        raise _refuse(CONFIG_NAME, "missing; an adapter needs adapter_config.json")
    size = path.stat().st_size
    if size == 0:
        raise _refuse(CONFIG_NAME, "the file is empty")
    if size > MAX_CONFIG_BYTES:
        raise _refuse(CONFIG_NAME, f"{size} bytes, above the {MAX_CONFIG_BYTES}-byte limit")
    raw = path.read_bytes()
    try:
        config = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        if looks_like_pickle(raw[:8]):
            raise pickle_refusal(CONFIG_NAME) from None
        raise _refuse(CONFIG_NAME, f"invalid JSON ({e})") from None
    if not isinstance(config, dict):
        raise _refuse(CONFIG_NAME, "expected a JSON object")
    return config


_TARGET_RE = re.compile(
    r"^(?:(?P<full>model\.)?layers\.(?P<layer>\d{1,6})\.)?(?:(?P<parent>self_attn|mlp)\.)?"
    r"(?P<module>[A-Za-z0-9_]+)$"
)


def _parse_target(entry: Any) -> tuple[str, int | None, bool]:
    """``(module, layer or None, exact)`` for one ``target_modules`` entry."""
    supported = ", ".join(SUPPORTED_MODULES)
    if not isinstance(entry, str) or not entry:
        raise _refuse("target_modules", f"entries must be module names, got {entry!r}")
    m = _TARGET_RE.match(entry)
    module = m["module"] if m else entry.rsplit(".", 1)[-1]
    if module not in SUPPORTED_MODULES:
        raise _refuse(
            "target_modules", f"{entry!r} is not a supported target module; supported: {supported}"
        )
    if m is None or (m["parent"] and m["parent"] != MODULE_PARENT[module]):
        raise _refuse(
            "target_modules",
            f"{entry!r}: expected a module name such as {module!r} or a path such as "
            f"'model.layers.0.{MODULE_PARENT[module]}.{module}'",
        )
    if m["layer"] is not None and not m["parent"]:
        raise _refuse(
            "target_modules",
            f"{entry!r} names no module of the model; expected "
            f"'model.layers.{m['layer']}.{MODULE_PARENT[module]}.{module}'",
        )
    layer = int(m["layer"]) if m["layer"] is not None else None
    if layer is not None and layer >= MAX_LAYER_INDEX:
        raise _refuse("target_modules", f"{entry!r}: layer index out of range")
    return module, layer, bool(m["full"])


def _parse_targets(
    value: Any, layers: tuple[int, ...] | None
) -> tuple[tuple[str, ...], tuple[tuple[int, str], ...]]:
    """``(target_modules, module_layers)`` from the config's ``target_modules``."""
    if value is None:
        raise _refuse("target_modules", "missing; expected a list of module names")
    if isinstance(value, str):
        if value == "all-linear":
            return SUPPORTED_MODULES, ()
        if value in SUPPORTED_MODULES:
            return (value,), ()
        raise _refuse(
            "target_modules",
            f"regular expressions ({value!r}) are not accepted; list the module names "
            f"(supported: {', '.join(SUPPORTED_MODULES)}) or use 'all-linear'",
        )
    if not isinstance(value, list | tuple) or not value:
        raise _refuse("target_modules", f"expected a non-empty list of module names, got {value!r}")
    everywhere: set[str] = set()
    pairs: set[tuple[int, str]] = set()
    for entry in value:
        module, layer, exact = _parse_target(entry)
        if layer is None:
            everywhere.add(module)
        elif exact or layers is None or layer in layers:
            # PEFT applies layers_to_transform to suffix matches, not to exact module paths.
            pairs.add((layer, module))
    pairs = {p for p in pairs if p[1] not in everywhere}
    modules = everywhere | {m for _, m in pairs}
    return tuple(m for m in SUPPORTED_MODULES if m in modules), tuple(sorted(pairs))


def _parse_layers(config: Mapping[str, Any]) -> tuple[int, ...] | None:
    value = config.get("layers_to_transform")
    pattern = config.get("layers_pattern")
    if pattern not in (None, "", "layers", [], ["layers"]):
        raise _refuse(
            "layers_pattern", f"expected 'layers' for a Llama-family model, got {pattern!r}"
        )
    if value is None or value == []:
        return None
    if isinstance(value, int) and not isinstance(value, bool):
        value = [value]
    if not isinstance(value, list) or not all(
        isinstance(i, int) and not isinstance(i, bool) and 0 <= i < MAX_LAYER_INDEX for i in value
    ):
        raise _refuse("layers_to_transform", f"expected layer indices, got {value!r}")
    return tuple(sorted(set(value)))


def _bool(config: Mapping[str, Any], key: str) -> bool:
    value = config.get(key, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise _refuse(key, f"expected true or false, got {value!r}")
    return value


def parse_config(config: Mapping[str, Any]) -> LoraSpec:
    """Turn an ``adapter_config.json`` dict into a :class:`LoraSpec`, refusing what is unsupported."""
    peft_type = config.get("peft_type")
    if peft_type != "LORA":
        raise _refuse("peft_type", f"expected 'LORA', got {peft_type!r}")
    for key, why in _REFUSED_FEATURES.items():
        if config.get(key):
            raise _refuse(key, why)
    bias = config.get("bias", "none")
    if bias != "none":
        raise _refuse("bias", f"trained biases are not supported; expected 'none', got {bias!r}")
    for key in ("rank_pattern", "alpha_pattern"):
        if config.get(key):
            raise _refuse(key, "per-module ranks or alphas are not supported; expected {}")
    r = config.get("r")
    if isinstance(r, bool) or not isinstance(r, int) or r <= 0:
        raise _refuse("r", f"expected a positive integer rank, got {r!r}")
    alpha = config.get("lora_alpha", 8)
    if (
        isinstance(alpha, bool)
        or not isinstance(alpha, int | float)
        or not math.isfinite(alpha)
        or alpha <= 0
    ):
        raise _refuse("lora_alpha", f"expected a positive number, got {alpha!r}")
    base = config.get("base_model_name_or_path")
    if base is not None and not isinstance(base, str):
        raise _refuse("base_model_name_or_path", f"expected a string, got {base!r}")
    layers = _parse_layers(config)
    targets, module_layers = _parse_targets(config.get("target_modules"), layers)
    return LoraSpec(
        r=r,
        lora_alpha=float(alpha),
        target_modules=targets,
        use_rslora=_bool(config, "use_rslora"),
        fan_in_fan_out=_bool(config, "fan_in_fan_out"),
        base_model_name_or_path=base or None,
        layers_to_transform=layers,
        module_layers=module_layers,
    )


def _weights_file(folder: Path) -> Path:
    weights = folder / WEIGHTS_NAME
    if not weights.is_file():
        for alt in (
            "adapter_model.bin",
            "adapter_model.pt",
            "adapter_model.pth",
            "adapter_model.pkl",
        ):
            if (folder / alt).exists():
                raise pickle_refusal(alt)
        raise _refuse(WEIGHTS_NAME, "missing; an adapter needs adapter_model.safetensors")
    return weights


_Pair = dict[str, TensorInfo]  # "A" / "B" -> header entry


def _collect(
    infos: Mapping[str, TensorInfo], spec: LoraSpec, dims: BaseModelDims | None
) -> dict[tuple[int, str], _Pair]:
    """Group tensors by (layer, module); refuse stray names and non-float dtypes."""
    found: dict[tuple[int, str], _Pair] = {}
    for key in sorted(infos):
        info = infos[key]
        m = TENSOR_KEY_RE.match(key)
        if m is None:
            raise AdapterValidationError(
                f"{key}: unexpected tensor; expected only LoRA weights named like "
                f"'{tensor_key(0, 'q_proj', 'A')}'",
                field=key,
            )
        layer, module = int(m["layer"]), m["module"]
        if module not in SUPPORTED_MODULES or MODULE_PARENT[module] != m["parent"]:
            raise AdapterValidationError(
                f"{key}: {module!r} is not a supported target module; supported: "
                f"{', '.join(SUPPORTED_MODULES)}",
                field=key,
            )
        if module not in spec.target_modules:
            raise AdapterValidationError(
                f"{key}: unexpected tensor; {module!r} is not in target_modules "
                f"{list(spec.target_modules)}",
                field=key,
            )
        if not spec.targets(layer, module):
            raise AdapterValidationError(
                f"{key}: unexpected tensor; target_modules / layers_to_transform put no "
                f"{module} LoRA in layer {layer}",
                field=key,
            )
        if dims is not None and layer >= dims.num_layers:
            raise AdapterValidationError(
                f"{key}: unexpected tensor; the base model has {dims.num_layers} layers", field=key
            )
        if layer >= MAX_LAYER_INDEX:
            raise AdapterValidationError(f"{key}: layer index {layer} is out of range", field=key)
        if info.dtype not in FLOAT_DTYPES:
            raise AdapterValidationError(
                f"{key}: dtype {info.dtype}; expected a float dtype ({', '.join(FLOAT_DTYPES)})",
                field=key,
            )
        found.setdefault((layer, module), {})[m["which"]] = info
    return found


def _shape_error(
    key: str, got: tuple[int, ...], want: tuple[int, ...], hint: str
) -> AdapterValidationError:
    return AdapterValidationError(
        f"{key}: shape {list(got)}, expected {list(want)}{hint}", field=key
    )


def _check_layers(spec: LoraSpec, dims: BaseModelDims) -> None:
    """Refuse layer indices the base model does not have."""
    layers = spec.layers_to_transform
    if layers and layers[-1] >= dims.num_layers:
        raise _refuse(
            "layers_to_transform",
            f"layer {layers[-1]} does not exist; the base model has {dims.num_layers} layers",
        )
    beyond = [i for i, _ in spec.module_layers if i >= dims.num_layers]
    if beyond:
        raise _refuse(
            "target_modules",
            f"layer {beyond[0]} does not exist; the base model has {dims.num_layers} layers",
        )


def _check_layout(
    found: dict[tuple[int, str], _Pair], spec: LoraSpec, dims: BaseModelDims | None, hint: str = ""
) -> None:
    """Refuse missing tensors and wrong shapes."""
    r = spec.r
    if dims is not None:
        expected = [
            (layer, module)
            for layer in range(dims.num_layers)
            for module in spec.target_modules
            if spec.targets(layer, module)
        ]
        if not expected:
            raise _refuse("target_modules", "selects no module of the base model")
    else:
        expected = sorted(found)
        if not expected:
            raise _refuse(WEIGHTS_NAME, "holds no LoRA tensors")
    seen_shapes: dict[str, tuple[int, int]] = {}
    for layer, module in expected:
        pair = found.get((layer, module), {})
        for which in ("A", "B"):
            if which not in pair:
                key = tensor_key(layer, module, which)
                raise AdapterValidationError(f"{key}: missing tensor", field=key)
        a, b = pair["A"], pair["B"]
        if dims is not None:
            in_f, out_f = dims.module_shape(module)
        else:
            in_f = a.shape[1] if len(a.shape) == 2 else -1
            out_f = b.shape[0] if len(b.shape) == 2 else -1
            in_f, out_f = seen_shapes.setdefault(module, (in_f, out_f))
        if a.shape != (r, in_f):
            raise _shape_error(a.name, a.shape, (r, in_f), hint)
        if b.shape != (out_f, r):
            raise _shape_error(b.name, b.shape, (out_f, r), hint)


def _load_layers(
    weights_path: Path, found: dict[tuple[int, str], _Pair], dtype: torch.dtype
) -> dict[int, dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    names = [info.name for pair in found.values() for info in pair.values()]
    tensors = load_tensors(weights_path, names, dtype=dtype)
    for name in names:
        if not bool(torch.isfinite(tensors[name]).all()):
            raise AdapterValidationError(
                f"{name}: contains NaN or infinite values (in {dtype}); expected finite weights",
                field=name,
            )
    layers: dict[int, dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}
    for layer, module in sorted(found):
        pair = found[(layer, module)]
        layers.setdefault(layer, {})[module] = (tensors[pair["A"].name], tensors[pair["B"].name])
    return layers


def _short_name(name: str | None) -> str | None:
    if not name:
        return None
    return name.rstrip("/").rsplit("/", 1)[-1].lower()


def load_adapter(path: str | os.PathLike, *, dtype: torch.dtype = torch.float32) -> LoraWeights:
    """Read a PEFT LoRA adapter folder or archive with no base-model checks.

    Checks the format (config, tensor names, ranks, A/B pairing, float dtype, finite
    values) but not the base model's dimensions. Raises :class:`AdapterValidationError`.
    """
    with adapter_folder(path) as folder:
        spec = parse_config(read_config(folder / CONFIG_NAME))
        weights_path = _weights_file(folder)
        found = _collect(read_header(weights_path), spec, None)
        _check_layout(found, spec, None)
        return LoraWeights(spec, _load_layers(weights_path, found, dtype))


def validate_adapter(
    path: str | os.PathLike,
    base_config: Any,
    *,
    max_lora_rank: int = DEFAULT_MAX_LORA_RANK,
    max_bytes: int = DEFAULT_MAX_ADAPTER_BYTES,
    base_model_name: str | None = None,
    dtype: torch.dtype = torch.float32,
    serving_dtype: torch.dtype = torch.bfloat16,
) -> LoraWeights:
    """Fully validate an adapter folder or archive against a base model; return its weights.
    Last, :func:`~loramux.adapters.probe.probe_adapter` in ``serving_dtype`` (its range is
    float32's for bfloat16) refuses adapters whose outputs overflow, naming the module.

    ``base_config`` is a transformers ``PretrainedConfig`` or the dict of ``config.json``.
    Checks: ``peft_type`` LORA; ``r`` ≤ ``max_lora_rank``; target modules supported; every
    expected tensor present and none stray; shapes match the base model; float dtype;
    finite values; ``adapter_model.safetensors`` at most ``max_bytes``; DoRA,
    ``modules_to_save``, trained biases and other unsupported features refused by name.
    A different ``base_model_name_or_path`` (compared by its last path component with
    ``base_model_name`` or the config's name) is only a warning in
    ``LoraWeights.warnings`` unless the shapes disagree.
    """
    dims = base_dims(base_config)
    with adapter_folder(path, max_bytes=max_bytes + MAX_CONFIG_BYTES) as folder:
        weights_path = folder / WEIGHTS_NAME
        if weights_path.is_file() and weights_path.stat().st_size > max_bytes:
            raise _refuse(
                "size",
                f"{WEIGHTS_NAME} is {weights_path.stat().st_size} bytes, above the limit of "
                f"{max_bytes} bytes",
            )
        spec = parse_config(read_config(folder / CONFIG_NAME))
        if spec.r > max_lora_rank:
            raise _refuse("r", f"rank {spec.r} is above max_lora_rank={max_lora_rank} (the serving limit, --max-lora-rank)")
        _check_layers(spec, dims)
        weights_path = _weights_file(folder)
        warnings: list[str] = []
        hint = ""
        ours = _short_name(base_model_name or dims.name_or_path)
        theirs = _short_name(spec.base_model_name_or_path)
        if ours and theirs and ours != theirs:
            hint = (
                f" (the adapter was trained on {spec.base_model_name_or_path!r}, "
                f"not on {base_model_name or dims.name_or_path!r})"
            )
        found = _collect(read_header(weights_path), spec, dims)
        _check_layout(found, spec, dims, hint)
        if hint:
            warnings.append(
                f"base_model_name_or_path is {spec.base_model_name_or_path!r} but the base model "
                f"is {base_model_name or dims.name_or_path!r}; the shapes match"
            )
            logger.warning("%s: %s", Path(path).name, warnings[-1])
        weights = LoraWeights(spec, _load_layers(weights_path, found, dtype), warnings)
    from loramux.adapters.probe import probe_adapter  # the probe reads LoraWeights

    probe_adapter(weights, serving_dtype)
    return weights


def save_adapter(weights: LoraWeights, path: str | os.PathLike) -> Path:
    """Write ``weights`` as a PEFT adapter folder (config + safetensors)."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    for layer, modules in weights.layers.items():
        for module, (a, b) in modules.items():
            tensors[tensor_key(layer, module, "A")] = a.contiguous()
            tensors[tensor_key(layer, module, "B")] = b.contiguous()
    save_file(tensors, str(path / WEIGHTS_NAME), metadata={"format": "pt"})
    (path / CONFIG_NAME).write_text(json.dumps(weights.spec.to_config(), indent=2) + "\n")
    return path
