"""Linear projections, with oneDNN-prepacked weights on the CPU.

A weight reordered once into oneDNN's blocked layout runs its matmuls about
1.5-2x faster on x86 CPUs than ``F.linear`` on the plain layout (fp32 and bf16,
small decode batches most of all). CUDA and CPUs without oneDNN use ``F.linear``.

oneDNN's bf16 matmuls need AVX-512 (BW/VL/DQ) or AVX-NE-CONVERT. On CPUs with
only AVX2 a bf16 weight is packed as float32 instead: activations are widened
for the matmul and the result narrowed back, which is both correct there (the
bf16 reorder refuses to run) and faster than ``F.linear``'s bf16 fallback.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_BATCH_HINT = 32  # typical decode batch; any batch size works with the packed weight
_PROJECT_CHUNK_ELEMS = 1 << 24  # project(): float32 copies of at most 64 MiB of an unpacked weight


def _can_pack(weight: torch.Tensor) -> bool:
    return (
        weight.device.type == "cpu"
        and weight.dtype in (torch.float32, torch.bfloat16)
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


def cpu_has_bf16_matmul() -> bool:
    """Whether oneDNN can run bf16 matmuls on this CPU (AVX-512 BF16 paths or AVX-NE-CONVERT)."""
    probe = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return bool(probe is not None and probe())


def _packed_dtype(dtype: torch.dtype) -> torch.dtype:
    if dtype == torch.bfloat16 and not cpu_has_bf16_matmul():
        return torch.float32
    return dtype


def matmul_dtype(dtype: torch.dtype, device: torch.device | str) -> torch.dtype:
    """The dtype that matmuls of ``dtype`` operands should run in on ``device``: float32 for
    bfloat16 on CPUs without oneDNN bf16 (there a bf16 GEMM is ~10x slower than fp32),
    else ``dtype``. The LoRA slot buffers follow it."""
    if torch.device(device).type == "cpu":
        return _packed_dtype(dtype)
    return dtype


class Linear:
    """``y = x @ W.T + b`` for x [T, in]; W [out, in] as loaded from the checkpoint."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, *, pack: bool = True) -> None:
        self.out_features, self.in_features = weight.shape
        self.dtype = weight.dtype
        self.bias = bias
        self.packed = pack and _can_pack(weight)
        self.compute_dtype = _packed_dtype(weight.dtype) if self.packed else weight.dtype
        # a packed weight cannot be read back: keep its rows' norms (DoRA reads them)
        self._row_norms = (torch.linalg.vector_norm(weight, dim=1, dtype=torch.float32)
                           if self.packed else None)
        if self.packed:
            packed = weight.to(self.compute_dtype).contiguous()
            if bias is not None:
                self.bias = bias.to(self.compute_dtype)
            self.weight = torch.ops.mkldnn._reorder_linear_weight(packed, _BATCH_HINT)
        else:
            self.weight = weight
        self.nbytes = weight.numel() * weight.element_size()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed:
            if self.compute_dtype != self.dtype:
                x = x.to(self.compute_dtype)
            y = torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.weight, self.bias, "none", [], "")
            return y.to(self.dtype)
        return F.linear(x, self.weight, self.bias)

    def row_norms(self) -> torch.Tensor:
        """``‖W[i]‖`` per output row, float32 [out] (DoRA's per-row scale reads it)."""
        if self._row_norms is None:
            self._row_norms = torch.linalg.vector_norm(self.weight, dim=1, dtype=torch.float32)
        return self._row_norms

    def project(self, a: torch.Tensor) -> torch.Tensor:
        """``a @ W.T`` without the bias, float32 [n, out], for a few rows a [n, in] (DoRA's
        cross term ``W · Aᵀ``): exact float32 for float32 weights and unpacked ones (in bounded
        chunks); a packed bf16 GEMM takes ``a`` in two bf16 parts, its outputs round to bf16."""
        if self.packed:
            def run(x: torch.Tensor) -> torch.Tensor:
                return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.weight, None, "none",
                                                          [], "").float()

            x = a.float()
            hi = x.to(self.compute_dtype)
            if self.compute_dtype == torch.float32:
                return run(hi)
            return run(hi) + run((x - hi.float()).to(self.compute_dtype))  # a in two bf16 parts
        x = a.to(self.weight.device, torch.float32)
        if self.weight.dtype == torch.float32:
            return F.linear(x, self.weight)
        rows = max(1, _PROJECT_CHUNK_ELEMS // self.in_features)  # bounded float32 copies of W
        return torch.cat([F.linear(x, self.weight[i : i + rows].float())
                          for i in range(0, self.out_features, rows)], dim=1)
