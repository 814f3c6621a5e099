"""Which :class:`~loramux.engine.model.quant.base.QuantMethod` a model folder gets: its
``config.json``'s ``quantization_config`` (``quant_method``), checked against
``--quantization`` as vLLM checks it."""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

from loramux.engine.errors import ModelLoadError
from loramux.engine.model.quant import QUANTIZATION_METHODS, check_quantization_name
from loramux.engine.model.quant.base import QuantMethod, UnquantizedMethod


def quantization_config(hf_config) -> Mapping[str, Any] | None:
    """The checkpoint's ``quantization_config`` as a dict (None: not quantized)."""
    qc = getattr(hf_config, "quantization_config", None)
    if qc is not None and not isinstance(qc, Mapping):
        qc = qc.to_dict() if hasattr(qc, "to_dict") else vars(qc)
    return qc


def quant_method(hf_config, requested: str | None, source: str) -> QuantMethod:
    """The method for the checkpoint of ``hf_config`` (from folder ``source``). ``requested``
    (``--quantization``) names the method the checkpoint must have; None takes the
    checkpoint's. Raises ``ValueError`` for a name this engine does not serve and
    :class:`ModelLoadError` for a checkpoint whose method is not served or does not match.
    Called once when the model loads."""
    check_quantization_name(requested)
    qc = quantization_config(hf_config)
    if qc is None:
        if requested is not None:
            raise ModelLoadError(f"{source}: quantization={requested!r} was asked for, but the "
                                 "checkpoint's config.json has no quantization_config")
        return UnquantizedMethod()
    method = qc.get("quant_method")
    if method not in QUANTIZATION_METHODS:
        raise ModelLoadError(f"{source}: quantization_config.quant_method {method!r} is not "
                             f"supported; supported: {', '.join(QUANTIZATION_METHODS)}")
    if requested is not None and requested != method:
        raise ModelLoadError(f"{source}: quantization={requested!r} does not match the "
                             f"checkpoint's quant_method {method!r}")
    return importlib.import_module(QUANTIZATION_METHODS[method]).METHOD(qc, source)
