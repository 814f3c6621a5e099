"""Which tensors an adapter holds and their shapes: the safetensors header grouped by
(layer, module) (:func:`collect_tensors`), refusing stray names, modules the base's family
has not, non-float dtypes (each named in the error), layers the base has not
(:func:`check_layers`), missing tensors and wrong shapes (:func:`check_layout`). Reads only
the header: the tensors themselves are loaded by :mod:`~loramux.adapters.format`.
"""

from __future__ import annotations

from collections.abc import Mapping

from loramux.adapters.arch import (
    LORA_MODULES,
    MODULE_PARENT,
    NON_TEXT_KEY_RE,
    TENSOR_KEY_RE,
    BaseModelDims,
    tensor_key,
)
from loramux.adapters.archive import WEIGHTS_NAME
from loramux.adapters.errors import AdapterValidationError
from loramux.adapters.experts import EXPERT_KEY_RE, ROUTER_KEY_RE
from loramux.adapters.safetensors_io import FLOAT_DTYPES, TensorInfo
from loramux.adapters.saved_modules import is_saved_key
from loramux.adapters.spec import MAX_LAYER_INDEX, LoraSpec, refuse
from loramux.adapters.vocab import VOCAB_KEY_RE

TensorPair = dict[str, TensorInfo]
"""``"A"`` / ``"B"`` (/ ``"M"``, DoRA's magnitude) -> its header entry."""


def _check_float(info: TensorInfo) -> None:
    """Refuse a tensor whose dtype is not a float one."""
    if info.dtype not in FLOAT_DTYPES:
        raise AdapterValidationError(
            f"{info.name}: dtype {info.dtype}; expected a float dtype ({', '.join(FLOAT_DTYPES)})",
            field=info.name,
        )


def collect_tensors(
    infos: Mapping[str, TensorInfo], spec: LoraSpec, dims: BaseModelDims | None
) -> tuple[dict[tuple[int, str], TensorPair], str, list[TensorInfo]]:
    """Group the text model's tensors by (layer, module); the decoder prefix of their names;
    the tensors of unserved parts (a multimodal base's vision tower). Refuse stray names,
    modules the base's family has not and non-float dtypes."""
    found: dict[tuple[int, str], TensorPair] = {}
    unserved: list[TensorInfo] = []
    prefixes: set[str] = set()
    arch = dims.arch if dims is not None else None
    accepted = dims.family.lora_modules if dims is not None else LORA_MODULES
    example = tensor_key(0, accepted[0], "A", arch.peft_prefix if arch is not None else "model.")
    for key in sorted(infos):
        info = infos[key]
        if (EXPERT_KEY_RE.match(key) or ROUTER_KEY_RE.match(key) or VOCAB_KEY_RE.match(key)
                or is_saved_key(key, spec.modules_to_save)):
            continue  # experts' and router's (experts.collect), embed/lm_head (vocab), modules_to_save
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


def check_layers(spec: LoraSpec, dims: BaseModelDims) -> None:
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


def check_layout(
    found: dict[tuple[int, str], TensorPair], spec: LoraSpec, dims: BaseModelDims | None, hint: str = "",
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
        if not expected and not spec.target_parameters and not spec.vocab_modules and not spec.trainable_tokens:
            raise refuse("target_modules", "selects no module of the base model")
    else:
        expected = sorted(found)
        if not expected and not spec.target_parameters and not spec.vocab_modules and not spec.trainable_tokens:
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
