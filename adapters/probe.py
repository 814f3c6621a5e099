"""The upload probe: refuse adapters whose outputs overflow in the serving dtype.

NaN/Inf values are refused by validation; finite but huge ones (``lora_B`` × 1e30) are
not, and at serving time they turn their requests' hidden states into NaN. So after
validation every module is checked twice, at a cost of microseconds per module:

* its weights, times the adapter's scale, must be representable in the serving dtype;
* a short probe forward of :data:`PROBE_TOKENS` unit-RMS tokens through ``B @ A · scale``
  in the serving dtype must stay finite and below :data:`PROBE_MAX_ABS` (a delta that
  large on a normalized input overflows the layers after it);
* a DoRA adapter's magnitudes (the norms of its weight's rows) must stay below
  :data:`PROBE_MAX_ABS` too. Its per-row scale ``m / ‖W0 + s·BA‖`` needs the base weights:
  the engine checks it when it loads the adapter (``engine/lora/dora.py``).
"""

from __future__ import annotations

import torch

from loramux.adapters.errors import AdapterValidationError
from loramux.adapters.weights import LoraWeights

PROBE_TOKENS = 4
"""Tokens of the probe forward (random, unit RMS like a normalized hidden state)."""
PROBE_MAX_ABS = 1e4
"""Largest |delta| a module may add to a unit-RMS input (trained adapters add O(1))."""


def probe_adapter(weights: LoraWeights, dtype: torch.dtype = torch.float32) -> None:
    """Raise :class:`AdapterValidationError` naming the first module (layer and name) whose
    scaled weights cannot be represented in ``dtype`` or whose probe output overflows."""
    limit = torch.finfo(dtype).max
    scale = weights.spec.scale
    gen = torch.Generator().manual_seed(0)
    for layer in sorted(weights.layers):
        for module, (a, b) in sorted(weights.layers[layer].items()):
            where = f"layer {layer} {module}"
            for name, t, s in (("lora_A", a, 1.0), ("lora_B", b, scale)):
                peak = float(t.detach().abs().max()) * abs(s) if t.numel() else 0.0
                if not peak <= limit:
                    raise AdapterValidationError(
                        f"weights: {where} {name} has values up to {peak:.3g} (scaled), beyond "
                        f"what {str(dtype).removeprefix('torch.')} can represent ({limit:.3g})",
                        field="weights")
            x = torch.randn(PROBE_TOKENS, a.shape[1], generator=gen).to(dtype)
            y = (x @ a.to(dtype).T) @ b.to(dtype).T * scale
            top = float(y.abs().max()) if y.numel() else 0.0
            if not top <= PROBE_MAX_ABS:
                raise AdapterValidationError(
                    f"weights: {where} overflows: a probe forward in "
                    f"{str(dtype).removeprefix('torch.')} gives outputs up to {top:.3g} for a "
                    f"unit-scale input (limit {PROBE_MAX_ABS:g}); the adapter would break its "
                    f"requests' numbers", field="weights")
            mag = weights.magnitudes.get(layer, {}).get(module)
            peak = float(mag.detach().abs().max()) if mag is not None and mag.numel() else 0.0
            if not peak <= PROBE_MAX_ABS:
                raise AdapterValidationError(
                    f"weights: {where} lora_magnitude_vector has values up to {peak:.3g} "
                    f"(limit {PROBE_MAX_ABS:g}): rows of a weight that large overflow its "
                    f"requests' numbers", field="weights")
    _probe_experts(weights, dtype, limit, gen)
    _probe_vocab(weights, dtype, gen)


def _probe_experts(weights: LoraWeights, dtype: torch.dtype, limit: float, gen) -> None:
    """The experts' LoRA (``LoraWeights.experts``) probed as the modules' are, every expert."""
    for layer in sorted(weights.experts):
        for param, (a, b) in sorted(weights.experts[layer].items()):
            where = f"layer {layer} {'mlp.gate' if param == 'router' else 'mlp.experts.' + param}"
            scale = weights.spec.expert_scale(param)
            peak = max(float(a.abs().max()), float(b.abs().max()) * abs(scale)) if a.numel() else 0.0
            if not peak <= limit:
                raise AdapterValidationError(
                    f"weights: {where} has values up to {peak:.3g} (scaled), beyond what "
                    f"{str(dtype).removeprefix('torch.')} can represent ({limit:.3g})", field="weights")
            if a.dim() == 2:  # the router's LoRA
                a, b = a.unsqueeze(0), b.unsqueeze(0)
            x = torch.randn(PROBE_TOKENS, a.shape[2], generator=gen).to(dtype)
            y = torch.einsum("tk,erk,eor->eto", x, a.to(dtype), b.to(dtype)) * scale
            top = float(y.abs().max()) if y.numel() else 0.0
            if not top <= PROBE_MAX_ABS:
                raise AdapterValidationError(
                    f"weights: {where} overflows: a probe forward in "
                    f"{str(dtype).removeprefix('torch.')} gives outputs up to {top:.3g} for a "
                    f"unit-scale input (limit {PROBE_MAX_ABS:g})", field="weights")


def _probe_vocab(weights: LoraWeights, dtype: torch.dtype, gen) -> None:
    """The vocabulary parts (``adapters/vocab.py``): an ``embed_tokens`` LoRA's rows for the
    whole vocabulary (in chunks), an ``lm_head`` LoRA's probe forward and trainable tokens' rows
    must stay below :data:`PROBE_MAX_ABS` in ``dtype``."""
    scale = weights.spec.scale
    for module, (a, b) in sorted(weights.vocab_lora.items()):
        if module == "embed_tokens":  # every token's delta row, A[:, t] @ B.T
            top = max((float(((a[:, i: i + 8192].T.to(dtype) @ b.to(dtype).T) * scale).abs().max())
                       for i in range(0, a.shape[1], 8192)), default=0.0)
        else:
            x = torch.randn(PROBE_TOKENS, a.shape[1], generator=gen).to(dtype)
            top = float(((x @ a.to(dtype).T) @ b.to(dtype).T * scale).abs().max())
        if not top <= PROBE_MAX_ABS:
            raise AdapterValidationError(
                f"weights: {module} LoRA overflows: its outputs reach {top:.3g} in "
                f"{str(dtype).removeprefix('torch.')} (limit {PROBE_MAX_ABS:g})", field="weights")
    for module, (_, rows) in sorted(weights.vocab_tokens.items()):
        top = float(rows.to(dtype).float().abs().max()) if rows.numel() else 0.0
        if not top <= PROBE_MAX_ABS:
            raise AdapterValidationError(
                f"weights: {module} trainable tokens have values up to {top:.3g} in "
                f"{str(dtype).removeprefix('torch.')} (limit {PROBE_MAX_ABS:g})", field="weights")
