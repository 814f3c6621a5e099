"""What the decoder asks of the step's adapters (the LoRA manager's ``LoRAStepBatch``): the
seam between the model and ``engine/lora``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch


class LoRAHook(Protocol):
    """Adds adapter deltas; attached by the LoRA manager, called by every layer."""

    def active(self) -> bool:
        """True when this step has tokens with an adapter."""

    def add(self, layer: int, group: str, x: torch.Tensor, y: torch.Tensor) -> None:
        """y[T, N] += LoRA delta of group ``group`` in ``layer`` for input x[T, K]."""

    def embed(self, input_ids: torch.Tensor, residual: torch.Tensor) -> None:
        """The embedding rows [T, H] of ``input_ids`` (before any embedding scale): the
        adapters' embedding LoRA and trainable tokens, in place."""

    def head(self, hidden: torch.Tensor, logits: torch.Tensor, logits_rows: torch.Tensor) -> None:
        """fp32 ``logits`` [B, V] of the final normalized ``hidden`` [B, H] (of tokens
        ``logits_rows``), before any soft-cap: the adapters' lm_head LoRA and trainable tokens."""

    def norm(self, key: tuple[int | None, str], fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
             source: torch.Tensor, out: torch.Tensor, rows: torch.Tensor | None = None) -> None:
        """``out``, the norm ``key`` (``(layer, checkpoint name)``; layer None: the final norm) of
        ``source`` by ``fn(x, weight)``: recomputed on the rows of adapters with their own copy
        (``rows``: ``source``'s batch tokens; None: all, in order)."""
