"""Defaults shared by the engine and the registry that need nothing heavy to import."""

from __future__ import annotations

DEFAULT_MAX_LORA_RANK = 16
"""The largest rank served and accepted when nothing says otherwise (``--max-lora-rank``);
the engine's ``LoRAConfig`` and the registry use this one default."""
