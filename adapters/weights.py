"""A loaded adapter (:class:`LoraWeights`) and its PEFT form on disk (:func:`save_adapter`).

What :mod:`~loramux.adapters.format` reads and checks, what the probe, the merge and the
engine's adapter tiers hold.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from loramux.adapters import experts, vocab
from loramux.adapters.arch import tensor_key
from loramux.adapters.archive import CONFIG_NAME, WEIGHTS_NAME
from loramux.adapters.spec import LoraSpec


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
    vocab_lora: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    """LoRA on ``embed_tokens`` (A [r, vocab], B [hidden, r]) and ``lm_head`` (A [r, hidden],
    B [vocab, r]), PEFT's orientation (``adapters/vocab.py``)."""
    vocab_tokens: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    """Trainable tokens per module: ``(ids int64 [n], rows [n, hidden])``, the rows themselves."""
    vocab_rows: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    """Rows of full copies of ``embed_tokens`` / ``lm_head`` that differ from the base
    (``adapters/full_copies.py``): ``(ids int64 [n], rows [n, hidden])`` per module they replace
    (never tied further: a tied base's ``base_layer`` copy is listed for both)."""
    full_copies: tuple[str, ...] = ()
    """Tensor names of those copies (stored; the equal ones need not be)."""
    norms: dict[str, torch.Tensor] = field(default_factory=dict)
    """``modules_to_save`` copies of norms: ``{module path: weight}`` (``adapters/saved_modules.py``)."""

    def num_bytes(self) -> int:
        """Bytes held by all A and B tensors (the experts' and the vocabulary parts' too) and DoRA
        magnitudes."""
        return sum(
            a.numel() * a.element_size() + b.numel() * b.element_size()
            for group in (self.layers, self.experts)
            for modules in group.values()
            for a, b in modules.values()
        ) + sum(m.numel() * m.element_size() for ms in self.magnitudes.values() for m in ms.values()) + sum(
            t.numel() * t.element_size()
            for pair in (*self.vocab_lora.values(), *self.vocab_tokens.values(), *self.vocab_rows.values())
            for t in pair) + sum(t.numel() * t.element_size() for t in self.norms.values())


def save_adapter(weights: LoraWeights, path: str | os.PathLike) -> Path:
    """Write ``weights`` as a PEFT adapter folder (config + safetensors)."""
    from safetensors.torch import save_file

    if weights.vocab_rows:
        raise ValueError("an adapter served with full copies' rows (adapters/full_copies.py) is written "
                         "from its original files, not rebuilt from its rows")
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
    tensors.update(vocab.peft_vocab_tensors(weights, weights.prefix))
    tensors.update({f"base_model.model.{path}.weight": t.contiguous() for path, t in weights.norms.items()})
    save_file(tensors, str(path / WEIGHTS_NAME), metadata={"format": "pt"})
    config = weights.spec.to_config(weights.prefix)
    (path / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")
    return path
