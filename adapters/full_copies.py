"""Full copies of the embedding layers an adapter ships, reduced to the rows that differ from
the served base.

PEFT writes two kinds: ``*.base_layer.weight`` (``save_embedding_layers``, part ``W``), which
PEFT loads *into* the base layer — on a base that ties ``lm_head`` to its embedding, the logits
change too —, and ``modules_to_save`` copies (part ``S``), which wrap the module alone (an
``embed_tokens`` copy never reaches the logits). Both are served as replacement rows, the same
mechanism as trainable tokens (``engine/lora/vocab.py``): the rows equal to the base's cost
nothing, the others are kept (an adapter that resized or retrained its vocabulary) under the
tenant's ``max_embedding_copy_bytes``, and refused past it with the size and the quota named.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from loramux.adapters.errors import AdapterValidationError
from loramux.adapters.safetensors_io import TensorInfo, load_tensors

__all__ = ["copy_rows", "ties_head"]

BaseTensor = Callable[[str], torch.Tensor | None]
"""``base_tensor("embed_tokens" | "lm_head")``: the served base's weight, float32 (None: unknown)."""


def _rows(weights_path, info: TensorInfo, module: str, base_tensor: BaseTensor | None,
          dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids, rows)`` of the copy ``info`` that differ from the base's ``module``."""
    base = base_tensor(module) if base_tensor is not None else None
    if base is None:
        raise AdapterValidationError(
            f"{info.name}: a full copy of {module} that cannot be compared with the served base "
            f"model's here; save the adapter with save_embedding_layers=False", field=info.name)
    copy = load_tensors(weights_path, [info.name], dtype=torch.float32)[info.name]
    if copy.shape != base.shape:
        raise AdapterValidationError(
            f"{info.name}: a copy of {module} of shape {list(copy.shape)} where the served base has "
            f"{list(base.shape)}: a resized vocabulary is not served (resize the embeddings to the "
            f"base's vocab_size, e.g. resize_token_embeddings(config.vocab_size))", field=info.name)
    if not bool(torch.isfinite(copy).all()):
        raise AdapterValidationError(f"{info.name}: contains NaN or infinite values; expected finite "
                                     f"weights", field=info.name)
    ids = (copy != base.to(torch.float32)).any(dim=1).nonzero().squeeze(1)
    return ids, copy.index_select(0, ids).to(dtype)


def copy_rows(weights_path, found: Mapping[tuple[str, str], TensorInfo], base_tensor: BaseTensor | None,
              *, dtype: torch.dtype, max_bytes: int | None = None,
              ) -> tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], list[str], tuple[str, ...]]:
    """The replacement rows of the full copies in ``found`` (parts ``W`` and ``S``) as
    ``{"embed_tokens" | "lm_head": (ids int64 [n], rows [n, hidden])}`` (a tied base's
    ``embed_tokens.base_layer`` rows reach its logits too: :func:`ties_head`), and a note per copy. ``max_bytes``: the most
    the kept rows may take (their stored bytes; None: unlimited), else refused naming both.
    Last, the tensor names of the copies that differ (the others need not be stored)."""
    out: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    notes: list[str] = []
    kept, names = 0, []
    for (module, part), info in sorted(found.items()):
        if part not in ("W", "S"):
            continue
        ids, rows = _rows(weights_path, info, module, base_tensor, dtype)
        if module in out:
            raise AdapterValidationError(f"{info.name}: a second copy of {module} (modules_to_save and "
                                         f"save_embedding_layers); expected one", field=info.name)
        if ids.numel() == 0:
            notes.append(f"{info.name}: a full copy of the base's {module}, equal to it: not stored")
            continue
        itemsize = (info.end - info.start) // max(1, info.shape[0] * info.shape[1])
        kept += ids.numel() * info.shape[1] * itemsize
        if max_bytes is not None and kept > max_bytes:
            raise AdapterValidationError(
                f"{info.name}: {ids.numel()} rows of {module} differ from the served base ({kept} bytes "
                f"with the adapter's other copied rows), above the tenant's max_embedding_copy_bytes "
                f"quota of {max_bytes}; ask the operator for a larger quota, or train the new tokens "
                f"with trainable_token_indices", field=info.name)
        out[module] = (ids, rows)
        names.append(info.name)
        notes.append(f"{info.name}: {ids.numel()} rows of {module} differ from the base's: served as "
                     f"the adapter's own rows")
    return out, notes, tuple(names)


def ties_head(copies: tuple[str, ...]) -> bool:
    """Whether the embedding rows of the copies named ``copies`` (``LoraWeights.full_copies``)
    came from its ``base_layer`` — which PEFT loads into the base's weight, the one a tied base's
    logits read — rather than from a ``modules_to_save`` copy, which wraps the embedding alone."""
    return any(name.endswith("embed_tokens.base_layer.weight") for name in copies)
