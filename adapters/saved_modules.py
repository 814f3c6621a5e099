"""PEFT's ``modules_to_save``: whole copies of base modules an adapter trained and ships
(``base_model.model.<module>.weight``), served for the adapter's rows only.

PEFT matches each ``modules_to_save`` entry against the end of every module's name (``["norm"]``
takes every RMSNorm of the model), so what is served follows the checkpoint's keys, not the
config string:

* norms (a layer's ``*norm`` — ``input_layernorm``, ``self_attn.q_norm``, ... — or the final
  ``norm``): vectors of the hidden (or head) size, kept whole and applied to the adapter's rows
  by the engine (``engine/lora/norms.py``); a copy equal to the base's costs nothing there;
* ``embed_tokens`` / ``lm_head`` (``adapters/vocab.py`` reads them as the ``S`` part): only the
  rows that differ from the served base are kept (``adapters/full_copies.py``), under the
  tenant's ``max_embedding_copy_bytes`` quota;
* anything else (a classification head such as ``score``, a projection) is refused naming it:
  a generation server has no use for it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch

from loramux.adapters.errors import AdapterValidationError
from loramux.adapters.safetensors_io import FLOAT_DTYPES, TensorInfo, load_tensors

__all__ = ["MAX_SAVED_ENTRIES", "collect_norms", "is_saved_key", "load_norms", "parse_modules_to_save"]

MAX_SAVED_ENTRIES = 64
"""Entries ``modules_to_save`` may list."""
SAVED_KEY_RE = re.compile(r"^base_model\.model\.(?P<path>[\w.]+?)\.(?P<param>weight|bias)$")
NORM_PATH_RE = re.compile(
    r"^(?P<prefix>(?:model\.)?(?:language_model\.)?)"
    r"(?:layers\.(?P<layer>\d+)\.(?P<name>(?:self_attn\.)?[a-z_]*norm)|(?P<final>norm))$")
_LORA_MARKERS = ("lora_", "base_layer", "token_adapter", "modules_to_save")


def _refuse(field_name: str, message: str) -> AdapterValidationError:
    return AdapterValidationError(f"{field_name}: {message}", field=field_name)


def parse_modules_to_save(value: Any) -> tuple[str, ...]:
    """``modules_to_save`` as a tuple of module-name suffixes (empty: none)."""
    if value is None or value == []:
        return ()
    if not isinstance(value, list | tuple) or not all(isinstance(v, str) and v.strip() for v in value):
        raise _refuse("modules_to_save", f"expected a list of module names, got {value!r:.80}")
    if len(value) > MAX_SAVED_ENTRIES:
        raise _refuse("modules_to_save", f"{len(value)} entries, above the limit of {MAX_SAVED_ENTRIES}")
    return tuple(dict.fromkeys(value))


def saved_path(key: str, entries: tuple[str, ...]) -> str | None:
    """The module path of ``key`` when it is a ``modules_to_save`` copy (its module's name ends
    with an entry, as PEFT matches them), else None."""
    m = SAVED_KEY_RE.match(key) if entries else None
    if m is None or any(marker in m["path"] for marker in _LORA_MARKERS):
        return None
    path = m["path"]
    return path if any(path.endswith(e) for e in entries) else None


def is_saved_key(key: str, entries: tuple[str, ...]) -> bool:
    """Whether ``key`` belongs to a module of ``modules_to_save`` (read here or by the
    vocabulary parts, not a stray tensor)."""
    return saved_path(key, entries) is not None


def collect_norms(infos: Mapping[str, TensorInfo], entries: tuple[str, ...], hidden: int | None,
                  head_dim: int | None, num_layers: int | None) -> dict[str, TensorInfo]:
    """The norm copies among ``modules_to_save``'s tensors: ``{module path: entry}`` (path
    relative to the model, e.g. ``model.layers.3.input_layernorm``); shapes ``[hidden]``
    (``[head_dim]`` for q/k norms), layers the base has. Refuses any other saved module but
    ``embed_tokens`` / ``lm_head`` (the vocabulary parts' ``S``), naming it."""
    found: dict[str, TensorInfo] = {}
    for key in sorted(infos):
        path = saved_path(key, entries)
        if path is None or re.search(r"(?:^|\.)(?:embed_tokens|lm_head)$", path):
            continue
        info = infos[key]
        m = NORM_PATH_RE.match(path)
        if m is None or key.endswith(".bias"):
            raise _refuse(key, f"modules_to_save: {path!r} is not served; loramux serves the adapter's "
                          f"own copies of norms, embed_tokens and lm_head (a classification head or a "
                          f"projection has no place in generation)")
        if info.dtype not in FLOAT_DTYPES:
            raise _refuse(key, f"dtype {info.dtype}; expected a float dtype ({', '.join(FLOAT_DTYPES)})")
        layer = int(m["layer"]) if m["layer"] is not None else None
        if layer is not None and num_layers is not None and layer >= num_layers:
            raise _refuse(key, f"layer {layer}; the base model has {num_layers} layers")
        want = head_dim if m["name"] in ("self_attn.q_norm", "self_attn.k_norm") else hidden
        if len(info.shape) != 1 or (want is not None and info.shape[0] != want):
            raise _refuse(key, f"shape {list(info.shape)}; expected [{want if want is not None else '?'}]")
        found[path] = info
    return found


def load_norms(weights_path, found: Mapping[str, TensorInfo], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The norm copies ``{module path: weight}`` in ``dtype``; refuses non-finite values."""
    tensors = load_tensors(weights_path, [i.name for i in found.values()], dtype=dtype)
    out = {}
    for path, info in found.items():
        t = tensors[info.name]
        if not bool(torch.isfinite(t).all()):
            raise _refuse(info.name, f"contains NaN or infinite values (in {dtype}); expected finite weights")
        out[path] = t
    return out


def norm_role(path: str) -> tuple[int | None, str]:
    """``(layer, name)`` of a norm path (``layer`` None: the final norm, name ``norm``)."""
    m = NORM_PATH_RE.match(path)
    if m is None:
        raise ValueError(f"{path!r} is not a norm's module path")
    return (int(m["layer"]), m["name"]) if m["layer"] is not None else (None, "norm")
