"""One step's CPU LoRA calls, laid out once per step: the engine's hot path on the CPU.

:class:`SgmvStep` is made by ``LoRAStepBatch.prepare`` when the slots are the torch backend's
pre-scaled block-diagonal layout on the CPU and the compiled kernels are loaded. It holds
what every layer call of the step shares (the kernel's run table, the long runs left to
GEMMs, the slots' ranks, each group's column offsets as the operator's tensor, the operator
itself), so a layer call is one check of its activations and one operator call: the
general entry (``torch_ops.add_lora_blockdiag``) cost ~7 us more per call, 0.9 ms of a
30-layer decode step's ~120 calls, more than a tenth of what the adapters' kernel costs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from loramux.engine.lora.meta import LoRABatchMeta
from loramux.engine.lora.ops import cpu_sgmv, torch_ops
from loramux.engine.model.kernels import loader

_FLOATS = (torch.float32, torch.bfloat16)


def slots_fit(a: Sequence[Mapping[str, torch.Tensor]], b: Sequence[Mapping[str, torch.Tensor]]) -> bool:
    """Whether every layer's slot tensors suit the kernel (CPU, fp32/bf16, contiguous, A and B
    of one dtype): asked once, when the engine starts."""
    return all(
        a_l[g].device.type == "cpu" and a_l[g].dtype in _FLOATS and a_l[g].dtype == b_l[g].dtype
        and a_l[g].is_contiguous() and b_l[g].is_contiguous()
        for a_l, b_l in zip(a, b, strict=True) for g in a_l
    )


class SgmvStep:
    """The CPU SGMV calls of one step (see the module docstring)."""

    def __init__(self, meta: LoRABatchMeta, slice_offsets: Mapping[str, Sequence[int]],
                 w_dtype: torch.dtype) -> None:
        """``w_dtype``: the slots' dtype (which runs the kernel takes depends on it)."""
        self.table, self.long, self.ranks = cpu_sgmv.split_runs(meta, w_dtype)
        self.slot_ranks = meta.slot_ranks.to(torch.int64).contiguous()
        self.slice_offsets = slice_offsets
        self.offsets = {g: cpu_sgmv.offsets_tensor(o) for g, o in slice_offsets.items()}
        self._op = loader.require().lora_sgmv.default if self.table.shape[0] else None

    @staticmethod
    def usable(meta: LoRABatchMeta) -> bool:
        """Whether this step can run on the kernel (loaded and on, and the step has runs)."""
        return bool(meta.runs) and loader.available()

    def add(self, group: str, y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> bool:
        """``y += `` the step's adapters' delta for ``x`` in ``group`` (A ``a`` pre-scaled, B ``b``
        block-diagonal). False, touching nothing, when x or y do not suit the kernel (dtype,
        strided rows): the caller then takes the general path."""
        if x.dtype not in _FLOATS or y.dtype not in _FLOATS or x.stride(1) != 1 or y.stride(1) != 1:
            return False
        if self._op is not None:
            self._op(y, x, a, b, self.table, self.slot_ranks, self.offsets[group])
        if self.long:
            torch_ops._add_runs_ranked(y, x, a, b, self.long, self.ranks, self.slice_offsets[group])
        return True
