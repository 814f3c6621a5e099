"""The quantization seam: what a method object is, the unquantized one, and the layer that
every weight-only format's projections are.

A :class:`QuantMethod` is asked once per projection while the model loads
(:meth:`QuantMethod.create_linear`, vLLM's ``create_weights``): it reads the checkpoint
tensors of that projection's modules (several for a fused q|k|v or gate|up, concatenated
along the output rows), checks them and returns the layer the forward pass calls. The
unquantized method returns the plain :class:`~loramux.engine.model.linear.Linear`; a
weight-only method returns a :class:`QuantLinear`, whose call is the method's
:meth:`WeightOnlyMethod.apply` and whose bytes are :meth:`WeightOnlyMethod.weight_bytes`.

:meth:`WeightOnlyMethod.apply` here runs a layer on a CUDA device by the Triton kernel
(``triton_wq.py``: the integer weights converted to its layout once, when the layer is made);
elsewhere it is the pure-torch path: it dequantizes ``TILE_ELEMS`` weights at a time (a band
of output rows, never the whole matrix) and multiplies the activations by each band in the
activations' matmul dtype.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from loramux.engine.model.linear import Linear, matmul_dtype

Take = Callable[..., torch.Tensor | None]
"""``take(name[, default])``: pops a canonical checkpoint tensor; without a default a missing
one raises ``ModelLoadError`` naming it (the decoder's loader)."""

Shape = tuple[int, int] | None
"""A module's weight shape ``(out_features, in_features)`` as the model's config says it
(None: the config does not say)."""

TILE_ELEMS = 1 << 20
"""Weights dequantized at once by the torch path (4 MiB of float32): a band of
``TILE_ELEMS // in_features`` output rows."""


class QuantMethod(ABC):
    """How one checkpoint format stores and runs the base model's projections."""

    name: str = "none"
    """vLLM's ``quantization`` name of the format (``none``: not quantized)."""
    quantized: bool = False
    """Whether any projection is stored quantized."""
    tensor_parallel_size: int = 1
    """The ranks the projections are split over (set by the model before it loads): a
    row-parallel share holds ``1 / tensor_parallel_size`` of a projection's input columns."""

    def keeps_stored_dtype(self, name: str) -> bool:
        """Whether checkpoint tensor ``name`` (canonical) loads in its stored dtype (packed
        integers, scales) rather than cast to the model's dtype. Called once per tensor while
        the folder is read."""
        return False

    @abstractmethod
    def create_linear(self, modules: Sequence[str], take: Take, bias: torch.Tensor | None, *,
                      shapes: Sequence[Shape], dtype: torch.dtype) -> Linear | QuantLinear:
        """The projection whose output rows are ``modules``' outputs in order (canonical module
        names without ``.weight``: one, or the parts of a fused q|k|v / gate|up), reading their
        tensors through ``take``; ``shapes`` are the config's shapes of the modules, ``dtype``
        the model's. Raises ``ModelLoadError`` naming the tensor that is missing or wrong.
        Called once per projection while the model loads."""

    def describe(self) -> str:
        """One line for the start-up log: the format and its schemes."""
        return self.name


class UnquantizedMethod(QuantMethod):
    """Float checkpoints: each module's ``.weight``, one oneDNN-packed ``Linear``."""

    def create_linear(self, modules: Sequence[str], take: Take, bias: torch.Tensor | None, *,
                      shapes: Sequence[Shape], dtype: torch.dtype) -> Linear:
        weights = [take(m + ".weight") for m in modules]
        return Linear(weights[0] if len(weights) == 1 else torch.cat(weights), bias)


class WeightOnlyMethod(QuantMethod):
    """A format whose weights are integers with float scales and whose activations stay in
    the model's dtype (W8A16, W4A16): the layers are :class:`QuantLinear`."""

    quantized = True

    @abstractmethod
    def dequantize_rows(self, layer: QuantLinear, start: int, stop: int) -> torch.Tensor:
        """Output rows ``start:stop`` of ``layer``'s weight, dequantized as the checkpoint's
        library dequantizes them ([stop - start, in], in its scales' dtype)."""

    def apply(self, layer: QuantLinear, x: torch.Tensor) -> torch.Tensor:
        """``x @ W.T + b`` for x [T, in] → [T, out] in the layer's dtype: the Triton kernel
        for a layer converted to its layout at load (CUDA, ``triton_wq.py``); else a band of
        rows of W dequantized at a time (``TILE_ELEMS``) into the activations' matmul dtype."""
        if "wq_weight" in layer.params:
            from loramux.engine.model.quant import triton_wq

            return triton_wq.apply(layer, x)
        x = x.to(layer.compute_dtype)
        y = x.new_empty(x.shape[0], layer.out_features)  # [T, out]
        b = layer.bias  # [out] or None
        for r0, r1, w in layer.bands():  # w [r1 - r0, in]
            y[:, r0:r1] = F.linear(x, w.to(layer.compute_dtype), b[r0:r1] if b is not None else None)
        return y.to(layer.dtype)

    def weight_bytes(self, layer: QuantLinear) -> int:
        """What the layer holds in memory: its stored tensors and bias."""
        tensors = [*layer.params.values(), *([layer.bias] if layer.bias is not None else [])]
        return sum(t.numel() * t.element_size() for t in tensors)


class QuantLinear:
    """A projection stored by a :class:`WeightOnlyMethod`: ``y = x @ W.T + b`` for x [T, in],
    W [out, in] dequantized from ``params`` by the method a band at a time. Answers what
    the LoRA code asks a :class:`~loramux.engine.model.linear.Linear` (``bias``,
    ``row_norms``, ``project``, ``nbytes``)."""

    def __init__(self, method: WeightOnlyMethod, params: dict[str, torch.Tensor],
                 bias: torch.Tensor | None, *, out_features: int, in_features: int,
                 dtype: torch.dtype, scheme: Any = None) -> None:
        self.method = method
        self.params = params  # the method's stored tensors (packed weights, scales), by name
        self.scheme = scheme  # the method's description of how they are stored
        self.out_features, self.in_features = out_features, in_features
        self.dtype = dtype
        self.device = next(iter(params.values())).device
        self.compute_dtype = matmul_dtype(dtype, self.device)
        self.bias = bias.to(self.compute_dtype) if bias is not None else None  # [out]
        self._row_norms: torch.Tensor | None = None
        # the method's compiled-kernel calls with this layer's arguments bound, as (columns to
        # gather x by or None, call) per part: built by the method at the first call it runs
        self.kernel_calls: list | None = None
        if self.device.type == "cuda":
            from loramux.engine.model.quant import triton_wq

            if triton_wq.HAS_TRITON:
                triton_wq.prepare(self)  # the stored tensors → the Triton kernel's layout, once

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self, x)

    def call_kernels(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ W.T + b`` through :attr:`kernel_calls` (bound by the method): one call, or one per
        part on the columns of x its ``perm`` gathers, the parts' outputs side by side."""
        calls = self.kernel_calls
        if len(calls) == 1 and calls[0][0] is None:
            return calls[0][1](x)
        outs = [call(x.index_select(-1, perm) if perm is not None else x) for perm, call in calls]
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)

    @property
    def kernel_in_features(self) -> int:
        """The input columns of the stored weight (the kernel's): ``in_features``, or more
        where a tensor-parallel share's groups were padded (``repacked.regroup``)."""
        return getattr(self.scheme, "kernel_in", None) or self.in_features

    def checkpoint_columns(self, w: torch.Tensor, start: int) -> torch.Tensor:
        """Output rows ``start:start + len(w)`` of the dequantized weight ``w``, given in the
        stored (kernel's) column order, in the checkpoint's input-column order [r, in]: each
        stored column added into the column its activations come from (``params["perm"]``
        [P, kernel in], one row per part of ``scheme.bounds``; a regrouped share's padding
        adds zeros). Without a ``perm`` the orders are the same."""
        if "perm" not in self.params:
            return w
        stop = start + w.shape[0]
        out = w.new_zeros(w.shape[0], self.in_features)
        bounds = self.scheme.bounds
        for i, perm in enumerate(self.params["perm"]):
            r0, r1 = max(bounds[i], start), min(bounds[i + 1], stop)
            if r0 < r1:
                out[r0 - start:r1 - start].index_add_(1, perm, w[r0 - start:r1 - start])
        return out

    @property
    def nbytes(self) -> int:
        """Bytes the stored weights take (``DecoderModel.weight_bytes``)."""
        return self.method.weight_bytes(self)

    def bands(self, rows: int | None = None):
        """``(start, stop, W[start:stop])`` over the dequantized weight in bands of ``rows``
        output rows (default: ``TILE_ELEMS`` weights a band)."""
        from loramux.engine.model.quant import triton_wq

        rows = rows or max(1, TILE_ELEMS // self.in_features)
        for r0 in range(0, self.out_features, rows):
            r1 = min(r0 + rows, self.out_features)
            yield r0, r1, (triton_wq.dequantize_rows(self, r0, r1) if "wq_weight" in self.params
                           else self.method.dequantize_rows(self, r0, r1))

    def row_norms(self) -> torch.Tensor:
        """``‖W[i]‖`` of the dequantized rows, float32 [out] (DoRA's per-row scale)."""
        if self._row_norms is None:
            self._row_norms = torch.cat([torch.linalg.vector_norm(w.float(), dim=1)
                                         for _, _, w in self.bands()])
        return self._row_norms

    def project(self, a: torch.Tensor) -> torch.Tensor:
        """``a @ W.T`` without the bias, float32 [n, out], for a few rows a [n, in] (DoRA's
        cross term), over the dequantized weight in float32."""
        x = a.to(self.device, torch.float32)
        return torch.cat([x @ w.float().T for _, _, w in self.bands()], dim=1)
