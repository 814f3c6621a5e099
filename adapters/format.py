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

import logging
import os
from pathlib import Path
from typing import Any

import torch

from loramux.adapters import alora, experts, probe, saved_modules, vocab
from loramux.adapters.arch import (
    base_dims,
    family_mismatch,
    text_config,
)
from loramux.adapters.archive import (
    CONFIG_NAME,
    WEIGHTS_NAME,
    adapter_folder,
)
from loramux.adapters.errors import AdapterValidationError, pickle_refusal
from loramux.adapters.experts import ROUTER
from loramux.adapters.full_copies import copy_rows
from loramux.adapters.layout import TensorPair, check_layers, check_layout, collect_tensors
from loramux.adapters.safetensors_io import (
    TensorInfo,
    load_tensors,
    read_header,
)
from loramux.adapters.spec import (
    DEFAULT_MAX_LORA_RANK,
    MAX_CONFIG_BYTES,
    LoraSpec,
    parse_config,
    read_config,
    refuse,
)
from loramux.adapters.weights import LoraWeights, save_adapter

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


def _load_layers(
    weights_path: Path, found: dict[tuple[int, str], TensorPair], dtype: torch.dtype
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


def _check_size(weights_path: Path, max_bytes: int) -> None:
    if weights_path.is_file() and weights_path.stat().st_size > max_bytes:
        raise refuse("size", f"{WEIGHTS_NAME} is {weights_path.stat().st_size} bytes, above the limit of "
                     f"{max_bytes} bytes")


def _short_name(name: str | None) -> str | None:
    if not name:
        return None
    return name.rstrip("/").rsplit("/", 1)[-1].lower()


def load_adapter(
    path: str | os.PathLike, *, dtype: torch.dtype = torch.float32, family: Any = None,
    base_tensor: Any = None,
) -> LoraWeights:
    """Read a PEFT LoRA adapter folder or archive with no base-model checks.

    Checks the format (config, tensor names, ranks, A/B pairing, float dtype, finite
    values) but not the base model's dimensions. ``family`` (the served base's
    :class:`~loramux.adapters.arch.BaseModelDims`) only says what ``all-linear`` means.
    Tensors of unserved parts (a vision tower) are not loaded. PEFT's full copies of the
    embedding layers are compared with ``base_tensor(module)`` when it is given (the engine's
    base, for adapters that never went through an upload), else not read. Raises
    :class:`AdapterValidationError`.
    """
    with adapter_folder(path) as folder:
        spec = parse_config(read_config(folder / CONFIG_NAME), family)
        weights_path = _weights_file(folder)
        header = read_header(weights_path)
        found, prefix, unserved = collect_tensors(header, spec, None)
        expert_found, _ = experts.collect(header, spec)
        check_layout(found, spec, None, prefix=prefix)
        layers, magnitudes = _load_layers(weights_path, found, dtype)
        vocab_lora, vocab_tokens, vocab_found = vocab.read_vocab(weights_path, header, spec, dtype)
        rows, kept = {}, ()
        if base_tensor is not None:
            rows, _, kept = copy_rows(weights_path, vocab_found, base_tensor, dtype=dtype)
            vocab.check_rows_and_tokens(rows, vocab_tokens)
        norms = saved_modules.load_norms(weights_path, saved_modules.collect_norms(
            header, spec.modules_to_save, None, None, None), dtype)
        return LoraWeights(spec, layers, prefix=prefix, unserved=tuple(i.name for i in unserved),
                           magnitudes=magnitudes, vocab_lora=vocab_lora, vocab_tokens=vocab_tokens,
                           vocab_rows=rows, full_copies=kept, norms=norms,
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
    base_tensor: Any = None,
    base_folder: str | os.PathLike | None = None,
    max_copy_bytes: int | None = None,
) -> LoraWeights:
    """Fully validate an adapter folder or archive against a base model; return its weights.
    Last, :func:`~loramux.adapters.probe.probe_adapter` in ``serving_dtype`` (its range is
    float32's for bfloat16) refuses adapters whose outputs overflow, naming the module.

    ``base_config`` is a transformers ``PretrainedConfig`` or the dict of ``config.json``.
    Checks: ``peft_type`` LORA; ``r`` ≤ ``max_lora_rank``; target modules supported; every
    expected tensor present and none stray; shapes match the base model; float dtype;
    finite values; ``adapter_model.safetensors`` at most ``max_bytes``; DoRA magnitude
    vectors (``use_dora``) present for every module, ``[out_features]``, finite;
    ``modules_to_save`` copies of norms kept (``adapters/saved_modules.py``), of the embedding
    layers reduced to the rows that differ from the base, at most ``max_copy_bytes`` of them (the
    tenant's ``max_embedding_copy_bytes``; None: unlimited), other modules refused by name;
    trained biases and other unsupported features refused by name;
    an aLoRA's ``alora_invocation_tokens`` token ids of the base's vocabulary; the vocabulary
    parts and shipped added tokens (:func:`~loramux.adapters.vocab.validate_vocab`).
    A different ``base_model_name_or_path`` (compared by its last path component with
    ``base_model_name`` or the config's name) is only a warning in
    ``LoraWeights.warnings`` unless the shapes disagree.
    """
    dims = base_dims(base_config)
    with adapter_folder(path, max_bytes=max_bytes + MAX_CONFIG_BYTES) as folder:
        _check_size(folder / WEIGHTS_NAME, max_bytes)
        spec = parse_config(read_config(folder / CONFIG_NAME), dims)
        vocab_size = text_config(base_config).get("vocab_size")
        if spec.alora_invocation_tokens is not None and isinstance(vocab_size, int):
            alora.check_vocab(spec.alora_invocation_tokens, vocab_size)
        mismatch = family_mismatch(spec.base_model_name_or_path, dims, base_model_name or dims.name_or_path)
        if mismatch:
            raise refuse("base_model_name_or_path", mismatch)
        if spec.max_rank > max_lora_rank:
            field_name = "r" if spec.r == spec.max_rank else "rank_pattern"
            raise refuse(field_name, f"rank {spec.max_rank} is above max_lora_rank={max_lora_rank} "
                         f"(the serving limit, --max-lora-rank)")
        check_layers(spec, dims)
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
        found, prefix, unserved = collect_tensors(header, spec, dims)
        check_layout(found, spec, dims, hint, prefix)
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
        vocab_lora, vocab_tokens, rows, kept = vocab.validate_vocab(
            folder, header, spec, dtype, base_config, warnings,
            str(base_folder or base_model_name or dims.name_or_path or ""), base_tensor, max_copy_bytes)
        norms = saved_modules.load_norms(weights_path, saved_modules.collect_norms(
            header, spec.modules_to_save, dims.hidden_size, dims.head_dim, dims.num_layers), dtype)
        weights = LoraWeights(spec, layers, warnings, prefix=prefix,
                              unserved=tuple(i.name for i in unserved), magnitudes=magnitudes,
                              vocab_lora=vocab_lora, vocab_tokens=vocab_tokens, vocab_rows=rows,
                              full_copies=kept, norms=norms,
                              experts=_load_experts(weights_path, expert_found, spec, dtype))
    probe.probe_adapter(weights, serving_dtype)  # through the module: a test hook replaces it
    return weights
