"""LoRA shrink/expand operators with a backend switch (pure torch or Triton).

Shapes (``T`` tokens in the step, ``T_lora`` = ``len(meta.sorted_token_idx)``):

* ``x``: ``[T, K]`` layer input; ``a_stack``: ``[num_slots, num_slices, R, K]``;
* ``v``: ``[num_slices, T_lora, R]`` fp32, rows in ``meta.sorted_token_idx`` order;
* ``b_stack``: ``[num_slots, N_total, R]``; ``y``: ``[T, N_total]`` updated in place;
* ``slice_offsets``: ``num_slices + 1`` ints, column ranges of the slices in ``y``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

import torch

from loramux.engine.lora.meta import LoRABatchMeta
from loramux.engine.lora.ops import torch_ops

__all__ = ["AddLoRA", "add_lora", "lora_expand", "lora_kernel", "lora_shrink", "resolve_backend",
           "triton_available"]

_BACKENDS = ("auto", "torch", "triton")


def triton_available() -> bool:
    """True when the Triton backend can be imported."""
    from loramux.engine.lora.ops import triton_ops

    return triton_ops.HAS_TRITON


def resolve_backend(name: str, device: torch.device | str) -> str:
    """Map a backend name to ``"torch"`` or ``"triton"`` for tensors on ``device``.

    ``"auto"`` picks Triton on CUDA when it imports, else torch. ``"triton"`` on a
    non-CUDA device is allowed only under ``TRITON_INTERPRET=1`` (tests).
    """
    if name not in _BACKENDS:
        raise ValueError(f"unknown LoRA backend {name!r}; expected one of {_BACKENDS}")
    dev = torch.device(device)
    if name == "torch":
        return "torch"
    if name == "auto":
        return "triton" if dev.type == "cuda" and triton_available() else "torch"
    if not triton_available():
        raise RuntimeError("LoRA backend 'triton' requested but triton is not installed")
    if dev.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(
            f"LoRA backend 'triton' needs a CUDA device (got {dev}); "
            "set TRITON_INTERPRET=1 to run the kernels on the CPU interpreter"
        )
    return "triton"


AddLoRA = Callable[..., None]
"""``kernel(y, x, a_stack, b_stack, meta, scale, slice_offsets)``: ``y += expand(shrink(x))``
for the step's LoRA tokens (the signature of :func:`add_lora` without its options)."""


def lora_kernel(backend: str, *, blockdiag: bool) -> AddLoRA:
    """The one function every LoRA layer of an engine calls, chosen once at start for a
    resolved ``backend`` (``torch`` | ``triton``, see :func:`resolve_backend`) and the slot
    layout (``blockdiag``: the torch backend's block-diagonal B, A pre-scaled)."""
    if blockdiag:
        if backend != "torch":
            raise ValueError("the block-diagonal slot layout is the torch backend's")
        return torch_ops.add_lora_blockdiag
    if backend == "triton":
        from loramux.engine.lora.ops import triton_ops

        def add_triton(y, x, a_stack, b_stack, meta: LoRABatchMeta, scale, slice_offsets) -> None:
            if meta.has_lora:
                v = triton_ops.lora_shrink(x, a_stack, meta, scale)
                triton_ops.lora_expand(v, b_stack, meta, y, slice_offsets)

        return add_triton
    if backend == "torch":
        return torch_ops.add_lora
    raise ValueError(f"unknown resolved LoRA backend {backend!r}; expected 'torch' or 'triton'")


def lora_shrink(
    x: torch.Tensor,
    a_stack: torch.Tensor,
    meta: LoRABatchMeta,
    scale: torch.Tensor,
    *,
    backend: str = "auto",
    deterministic: bool = False,
) -> torch.Tensor:
    """``v[s, i] = scale[slot] * A[slot, s] @ x[sorted_token_idx[i]]`` -> ``[num_slices, T_lora, R]`` fp32.

    Called by every LoRA layer, once per forward, before :func:`lora_expand`.
    Rows of tokens whose slot has rank 0 are zero. ``deterministic`` disables split-K
    atomics in the Triton backend (the torch backend is always deterministic).
    """
    if resolve_backend(backend, x.device) == "triton":
        from loramux.engine.lora.ops import triton_ops

        return triton_ops.lora_shrink(x, a_stack, meta, scale, deterministic=deterministic)
    return torch_ops.lora_shrink(x, a_stack, meta, scale)


def lora_expand(
    v: torch.Tensor,
    b_stack: torch.Tensor,
    meta: LoRABatchMeta,
    y: torch.Tensor,
    slice_offsets: Sequence[int],
    *,
    backend: str = "auto",
) -> None:
    """``y[tok, off[s]:off[s+1]] += B[slot, off[s]:off[s+1]] @ v[s, i]`` in place, per slice ``s``.

    Called right after :func:`lora_shrink` with its output. Rows of tokens with no
    adapter are not touched. Accumulates in fp32 on Triton; on CPU in y's dtype.
    """
    if resolve_backend(backend, y.device) == "triton":
        from loramux.engine.lora.ops import triton_ops

        triton_ops.lora_expand(v, b_stack, meta, y, slice_offsets)
        return
    torch_ops.lora_expand(v, b_stack, meta, y, slice_offsets)


def add_lora(
    y: torch.Tensor,
    x: torch.Tensor,
    a_stack: torch.Tensor,
    b_stack: torch.Tensor,
    meta: LoRABatchMeta,
    scale: torch.Tensor | None,
    slice_offsets: Sequence[int],
    *,
    backend: str = "auto",
    deterministic: bool = False,
    blockdiag: bool = False,
) -> None:
    """``y += expand(shrink(x))`` for every token with an adapter; no-op without LoRA tokens.

    The one entry point of every LoRA layer, for both backends. ``blockdiag``: ``b_stack``
    is the torch backend's block-diagonal layout (see ``SlotBuffers``) and ``scale`` None
    means A is already scaled; the Triton kernels read the stacked layout.
    """
    if not meta.has_lora:
        return
    name = resolve_backend(backend, x.device)
    if blockdiag:
        if name != "torch":
            raise ValueError("the block-diagonal slot layout is the torch backend's")
        torch_ops.add_lora_blockdiag(y, x, a_stack, b_stack, meta, scale, slice_offsets)
        return
    if name == "torch":
        torch_ops.add_lora(y, x, a_stack, b_stack, meta, scale, slice_offsets)
        return
    v = lora_shrink(x, a_stack, meta, scale, backend=name, deterministic=deterministic)
    lora_expand(v, b_stack, meta, y, slice_offsets, backend=name)
