"""What the API and the dashboard call an adapter, from its ``adapter_config.json``: one
source for the engine's spec (:attr:`~loramux.adapters.spec.LoraSpec.kind`) and the registry's
handles (stored config)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

KIND_PATTERN = r"^(LoRA|DoRA|aLoRA)(\+embedding)?(\+tokens)?(\+modules)?$"
"""Every kind: the base kind, then its parts in this order."""


def adapter_kind(config: Mapping[str, Any]) -> str:
    """``"aLoRA"`` (``alora_invocation_tokens``), ``"DoRA"`` (``use_dora``) or ``"LoRA"``, then
    ``"+embedding"`` (LoRA on ``embed_tokens`` / ``lm_head``), ``"+tokens"`` (trainable tokens),
    ``"+modules"`` (``modules_to_save`` copies)."""
    from loramux.adapters.vocab import split_vocab_targets

    if config.get("alora_invocation_tokens"):
        kind = "aLoRA"
    else:
        kind = "DoRA" if config.get("use_dora") else "LoRA"
    if split_vocab_targets(config.get("target_modules"))[1]:
        kind += "+embedding"
    kind += "+tokens" if config.get("trainable_token_indices") else ""
    return kind + ("+modules" if config.get("modules_to_save") else "")
