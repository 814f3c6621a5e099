"""Quantized base models: one method object per checkpoint format (vLLM's ``quant_method``).

A :class:`~loramux.engine.model.quant.base.QuantMethod` says which checkpoint tensors a
projection reads, how it runs and what it costs in memory; :func:`~loramux.engine.model.quant.
select.quant_method` picks one from ``config.json``'s ``quantization_config`` (and checks
``--quantization``). The model code asks the method for each projection and never knows which
format it got. The LoRA delta stays a separate shrink/expand beside whatever base GEMM runs.

This module names the methods only (no torch import): ``engine/config.py`` checks
``--quantization`` against it.
"""

from __future__ import annotations

QUANTIZATION_METHODS: dict[str, str] = {
    "compressed-tensors": "loramux.engine.model.quant.compressed_tensors",
    "awq": "loramux.engine.model.quant.awq",
    "gptq": "loramux.engine.model.quant.gptq",
}
"""vLLM's ``quantization`` names this engine serves → the module holding the method (its
``METHOD`` class). Every other name (``fp8``, ``bitsandbytes``, ...) is refused, naming these."""


def check_quantization_name(name: str | None) -> None:
    """Raise ``ValueError`` naming the supported methods when ``name`` (``--quantization``)
    is not one of them; None (read the checkpoint's) passes."""
    if name is not None and name not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization {name!r} is not supported; supported: "
                         f"{', '.join(QUANTIZATION_METHODS)}")
