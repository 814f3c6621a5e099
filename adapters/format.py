"""The PEFT LoRA adapter format: check, load, save (the config's side is ``spec.py``).

An adapter is a folder (or one ``.tar.gz`` / ``.zip`` archive of it) holding
``adapter_config.json`` and ``adapter_model.safetensors`` with PEFT's tensor names::

    base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight   # [r, in_features]
    base_model.model.model.layers.{i}.mlp.down_proj.lora_B.weight      # [out_features, r]
    base_model.model.model.layers.{i}.mlp.down_proj.lora_magnitude_vector  # [out_features], DoRA

:func:`load_adapter` reads one with no base-model checks (the engine calls it on adapters
the registry has already validated); :func:`validate_adapter` runs every check against a
base model config (the registry calls it on upload). Safetensors only: nothing here calls
``torch.load`` or unpickles anything.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from loramux.adapters import experts
from loramux.adapters.arch import (
    LORA_MODULES,
    MODULE_PARENT,
    NON_TEXT_KEY_RE,
    TENSOR_KEY_RE,
    BaseModelDims,
    base_dims,
    family_mismatch,
    tensor_key,
)
from loramux.adapters.archive import (
    CONFIG_NAME,
    WEIGHTS_NAME,
    adapter_folder,
)
from loramux.adapters.errors import AdapterValidationError, pickle_refusal
from loramux.adapters.experts import EXPERT_KEY_RE, ROUTER, ROUTER_KEY_RE
from loramux.adapters.safetensors_io import (
    FLOAT_DTYPES,
    TensorInfo,
    load_tensors,
    read_header,
)
from loramux.adapters.spec import (
    DEFAULT_MAX_LORA_RANK,
    MAX_CONFIG_BYTES,
    MAX_LAYER_INDEX,
    LoraSpec,
    parse_config,
    read_config,
    refuse,
)

__all__ = [
    "DEFAULT_MAX_ADAPTER_BYTES",
    "AdapterValidationError",
    "LoraWeights",
    "load_adapter",
    "save_adapter",
    "validate_adapter",
]

logger = logging.getLogger(__name__)

DEFAULT_MAX_ADAPTER_BYTES = 1024**3


@dataclass
class LoraWeights:
    """A loaded adapter.

    ``layers[i][module] = (A, B)`` with A ``[r, in_features]`` and B ``[out_features, r]``,
    ``module`` as the adapter names it (split ``q_proj`` or fused ``qkv_proj``); a layer or
    module without tensors has no LoRA. ``warnings`` carries what validation noticed but
    accepted (a different ``base_model_name_or_path``). ``prefix`` is where the decoder sits
    in its tensor names (``model.``; ``model.language_model.`` for a multimodal base);
    ``unserved`` names the tensors of parts the engine does not run (a vision tower).
    A DoRA adapter (``spec.use_dora``) has ``magnitudes[i][module]``, the learned magnitude
    ``m`` [out_features] of every module that has A and B: its weight is
    ``m ⊙ (W0 + s·BA) / ‖W0 + s·BA‖`` (the norm per output row).
    """

    spec: LoraSpec
    layers: dict[int, dict[str, tuple[torch.Tensor, torch.Tensor]]]
    warnings: list[str] = field(default_factory=list)
    prefix: str = "model."
    unserved: tuple[str, ...] = ()
    experts: dict[int, dict[str, tuple[torch.Tensor, torch.Tensor]]] = field(default_factory=dict)
    """``experts[i][param] = (A [E, r, in], B [E, out, r])``: LoRA on layer i's expert
    parameter ``param`` (``gate_up_proj``, ``down_proj``; ``experts.py``)."""
    magnitudes: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)
    dora_scales: dict[int, dict[str, tuple[torch.Tensor, torch.Tensor | None]]] = field(
        default_factory=dict)
    """Filled by the engine when it loads a DoRA adapter against its base weights: per layer
    and module, ``(g, c)`` with ``g = m / ‖W0 + s·BA‖`` fp32 [out_features] and ``c`` the bias
    correction ``(1 - g) ⊙ bias`` (None when the base projection has no bias)."""

    def num_bytes(self) -> int:
        """Bytes held by all A and B tensors (the experts' too) and DoRA magnitudes."""
        return sum(
            a.numel() * a.element_size() + b.numel() * b.element_size()
            for group in (self.layers, self.experts)
            for modules in group.values()
            for a, b in modules.values()
        ) + sum(m.numel() * m.element_size() for ms in self.magnitudes.values() for m in ms.values())


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
        raise refuse(WEIGHTS_NAME, "missing; an adapter needs adapter_model.safetensors")
    return weights


_Pair = dict[str, TensorInfo]  # "A" / "B" -> header entry


def _check_float(info: TensorInfo) -> None:
    if info.dtype not in FLOAT_DTYPES:
        raise AdapterValidationError(
            f"{info.name}: dtype {info.dtype}; expected a float dtype ({', '.join(FLOAT_DTYPES)})",
            field=info.name,
        )


def _collect(
    infos: Mapping[str, TensorInfo], spec: LoraSpec, dims: BaseModelDims | None
) -> tuple[dict[tuple[int, str], _Pair], str, list[TensorInfo]]:
    """Group the text model's tensors by (layer, module); the decoder prefix of their names;
    the tensors of unserved parts (a multimodal base's vision tower). Refuse stray names,
    modules the base's family has not and non-float dtypes."""
    found: dict[tuple[int, str], _Pair] = {}
    unserved: list[TensorInfo] = []
    prefixes: set[str] = set()
    arch = dims.arch if dims is not None else None
    accepted = dims.family.lora_modules if dims is not None else LORA_MODULES
    example = tensor_key(0, accepted[0], "A", arch.peft_prefix if arch is not None else "model.")
    for key in sorted(infos):
        info = infos[key]
        if EXPERT_KEY_RE.match(key) or ROUTER_KEY_RE.match(key):
            continue  # the experts' and the router's (experts.collect)
        m = TENSOR_KEY_RE.match(key)
        if m is None:
            if NON_TEXT_KEY_RE.match(key) and (arch is None or arch.ignored_prefixes):
                _check_float(info)
                unserved.append(info)
                continue
            raise AdapterValidationError(
                f"{key}: unexpected tensor; expected only LoRA weights named like '{example}'",
                field=key,
            )
        layer, module = int(m["layer"]), m["module"]
        prefixes.add(m["prefix"])
        if arch is not None and m["prefix"] not in (arch.peft_prefix, *arch.peft_prefix_aliases):
            raise AdapterValidationError(
                f"{key}: unexpected tensor name; the base model ({arch.name}) has its layers "
                f"under '{arch.peft_prefix}' (expected names like '{example}'): the adapter was "
                f"trained for another architecture",
                field=key,
            )
        if module not in accepted or MODULE_PARENT.get(module) != m["parent"]:
            family = f" of {dims.family.title} models" if dims is not None else ""
            raise AdapterValidationError(
                f"{key}: {module!r} is not a supported target module{family}; supported: "
                f"{', '.join(accepted)}",
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
        if m["magnitude"] and not spec.use_dora:
            raise AdapterValidationError(
                f"{key}: a DoRA magnitude vector, but adapter_config.json does not set use_dora",
                field=key,
            )
        if dims is not None and not dims.has_module(layer, module):
            raise AdapterValidationError(
                f"{key}: unexpected tensor; layer {layer} of the base model is a mixture-of-experts "
                f"layer with no dense {module} (its experts are targeted through target_parameters)",
                field=key,
            )
        _check_float(info)
        found.setdefault((layer, module), {})["M" if m["magnitude"] else m["which"]] = info
    if len(prefixes) > 1:
        raise refuse(WEIGHTS_NAME, f"tensor names mix decoder paths {sorted(prefixes)}")
    prefix = prefixes.pop() if prefixes else (arch.peft_prefix if arch is not None else "model.")
    return found, prefix, unserved


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
        raise refuse(
            "layers_to_transform",
            f"layer {layers[-1]} does not exist; the base model has {dims.num_layers} layers",
        )
    beyond = [i for i, _ in spec.module_layers if i >= dims.num_layers]
    if beyond:
        raise refuse(
            "target_modules",
            f"layer {beyond[0]} does not exist; the base model has {dims.num_layers} layers",
        )


def _check_layout(
    found: dict[tuple[int, str], _Pair], spec: LoraSpec, dims: BaseModelDims | None, hint: str = "",
    prefix: str = "model.",
) -> None:
    """Refuse missing tensors and wrong shapes."""
    r = spec.r
    if dims is not None:
        expected = [
            (layer, module)
            for layer in range(dims.num_layers)
            for module in spec.target_modules
            if spec.targets(layer, module) and dims.has_module(layer, module)
        ]
        if not expected and not spec.target_parameters:
            raise refuse("target_modules", "selects no module of the base model")
    else:
        expected = sorted(found)
        if not expected and not spec.target_parameters:
            raise refuse(WEIGHTS_NAME, "holds no LoRA tensors")
    seen_shapes: dict[str, tuple[int, int]] = {}
    for layer, module in expected:
        pair = found.get((layer, module), {})
        for which in ("A", "B", *("M" if spec.use_dora else ())):
            if which not in pair:
                key = tensor_key(layer, module, which, prefix)
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
        if spec.use_dora and pair["M"].shape != (out_f,):
            raise _shape_error(pair["M"].name, pair["M"].shape, (out_f,), hint)


def _load_layers(
    weights_path: Path, found: dict[tuple[int, str], _Pair], dtype: torch.dtype
) -> tuple[dict[int, dict[str, tuple[torch.Tensor, torch.Tensor]]], dict[int, dict[str, torch.Tensor]]]:
    """``(layers, magnitudes)`` as :class:`LoraWeights` holds them; refuses non-finite values."""
    names = [info.name for pair in found.values() for info in pair.values()]
    tensors = load_tensors(weights_path, names, dtype=dtype)
    for name in names:
        if not bool(torch.isfinite(tensors[name]).all()):
            raise AdapterValidationError(
                f"{name}: contains NaN or infinite values (in {dtype}); expected finite weights",
                field=name,
            )
    layers: dict[int, dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}
    magnitudes: dict[int, dict[str, torch.Tensor]] = {}
    for layer, module in sorted(found):
        pair = found[(layer, module)]
        layers.setdefault(layer, {})[module] = (tensors[pair["A"].name], tensors[pair["B"].name])
        if "M" in pair:
            magnitudes.setdefault(layer, {})[module] = tensors[pair["M"].name]
    return layers, magnitudes


def _load_experts(weights_path: Path, found: dict, spec: LoraSpec, dtype: torch.dtype):
    """The experts' LoRA as ``{layer: {param: (A [E, r, in], B [E, out, r])}}``."""
    names = [info.name for pair in found.values() for info in pair.values()]
    tensors = load_tensors(weights_path, names, dtype=dtype)
    out: dict[int, dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}
    for (layer, param), pair in sorted(found.items()):
        a, b = tensors[pair["A"].name], tensors[pair["B"].name]
        for t, info in ((a, pair["A"]), (b, pair["B"])):
            if not bool(torch.isfinite(t).all()):
                raise AdapterValidationError(f"{info.name}: contains NaN or infinite values (in {dtype}); "
                                             f"expected finite weights", field=info.name)
        r = spec.expert_rank(param)
        if param == ROUTER:
            out.setdefault(layer, {})[param] = (a, b)
            continue
        if a.dim() != 2 or a.shape[0] % r or b.dim() != 2 or b.shape[1] != a.shape[0]:
            raise AdapterValidationError(
                f"{pair['A'].name}: shape {list(a.shape)} / lora_B {list(b.shape)} is not PEFT's "
                f"[experts * {r}, in] / [out, {r} * experts]", field=pair["A"].name)
        out.setdefault(layer, {})[param] = experts.to_experts(a, b, a.shape[0] // r)
    return out


def _check_finite(weights_path: Path, infos: list[TensorInfo]) -> None:
    for info in infos:
        t = load_tensors(weights_path, [info.name], dtype=torch.float32)[info.name]
        if not bool(torch.isfinite(t).all()):
            raise AdapterValidationError(
                f"{info.name}: contains NaN or infinite values; expected finite weights",
                field=info.name,
            )


def _short_name(name: str | None) -> str | None:
    if not name:
        return None
    return name.rstrip("/").rsplit("/", 1)[-1].lower()


def load_adapter(
    path: str | os.PathLike, *, dtype: torch.dtype = torch.float32, family: Any = None
) -> LoraWeights:
    """Read a PEFT LoRA adapter folder or archive with no base-model checks.

    Checks the format (config, tensor names, ranks, A/B pairing, float dtype, finite
    values) but not the base model's dimensions. ``family`` (the served base's
    :class:`~loramux.adapters.arch.BaseModelDims`) only says what ``all-linear`` means.
    Tensors of unserved parts (a vision tower) are not loaded. Raises
    :class:`AdapterValidationError`.
    """
    with adapter_folder(path) as folder:
        spec = parse_config(read_config(folder / CONFIG_NAME), family)
        weights_path = _weights_file(folder)
        header = read_header(weights_path)
        found, prefix, unserved = _collect(header, spec, None)
        expert_found, _ = experts.collect(header, spec)
        _check_layout(found, spec, None, prefix=prefix)
        layers, magnitudes = _load_layers(weights_path, found, dtype)
        return LoraWeights(spec, layers, prefix=prefix, unserved=tuple(i.name for i in unserved),
                           magnitudes=magnitudes,
                           experts=_load_experts(weights_path, expert_found, spec, dtype))


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
    finite values; ``adapter_model.safetensors`` at most ``max_bytes``; DoRA magnitude
    vectors (``use_dora``) present for every module, ``[out_features]``, finite;
    ``modules_to_save``, trained biases and other unsupported features refused by name.
    A different ``base_model_name_or_path`` (compared by its last path component with
    ``base_model_name`` or the config's name) is only a warning in
    ``LoraWeights.warnings`` unless the shapes disagree.
    """
    dims = base_dims(base_config)
    with adapter_folder(path, max_bytes=max_bytes + MAX_CONFIG_BYTES) as folder:
        weights_path = folder / WEIGHTS_NAME
        if weights_path.is_file() and weights_path.stat().st_size > max_bytes:
            raise refuse(
                "size",
                f"{WEIGHTS_NAME} is {weights_path.stat().st_size} bytes, above the limit of "
                f"{max_bytes} bytes",
            )
        spec = parse_config(read_config(folder / CONFIG_NAME), dims)
        mismatch = family_mismatch(spec.base_model_name_or_path, dims, base_model_name or dims.name_or_path)
        if mismatch:
            raise refuse("base_model_name_or_path", mismatch)
        if spec.max_rank > max_lora_rank:
            field_name = "r" if spec.r == spec.max_rank else "rank_pattern"
            raise refuse(field_name, f"rank {spec.max_rank} is above max_lora_rank={max_lora_rank} "
                         f"(the serving limit, --max-lora-rank)")
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
        header = read_header(weights_path)
        found, prefix, unserved = _collect(header, spec, dims)
        _check_layout(found, spec, dims, hint, prefix)
        expert_found, _ = experts.collect(header, spec)
        experts.check(expert_found, spec, dims, hint)
        if hint:
            warnings.append(
                f"base_model_name_or_path is {spec.base_model_name_or_path!r} but the base model "
                f"is {base_model_name or dims.name_or_path!r}; the shapes match"
            )
            logger.warning("%s: %s", Path(path).name, warnings[-1])
        if unserved:
            _check_finite(weights_path, unserved)
            warnings.append(
                f"{len(unserved)} LoRA tensors of the vision tower are kept for export but not "
                f"served (loramux serves {dims.arch.name} text-only)"
            )
        layers, magnitudes = _load_layers(weights_path, found, dtype)
        weights = LoraWeights(spec, layers, warnings, prefix=prefix,
                              unserved=tuple(i.name for i in unserved), magnitudes=magnitudes,
                              experts=_load_experts(weights_path, expert_found, spec, dtype))
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
            tensors[tensor_key(layer, module, "A", weights.prefix)] = a.contiguous()
            tensors[tensor_key(layer, module, "B", weights.prefix)] = b.contiguous()
    for layer, modules in weights.magnitudes.items():
        for module, m in modules.items():
            tensors[tensor_key(layer, module, "M", weights.prefix)] = m.contiguous()
    tensors.update(experts.peft_tensors(weights, weights.prefix))
    save_file(tensors, str(path / WEIGHTS_NAME), metadata={"format": "pt"})
    config = weights.spec.to_config(weights.prefix)
    (path / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")
    return path
