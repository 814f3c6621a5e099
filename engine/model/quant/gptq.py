"""GPTQ checkpoints (``quant_method: "gptq"``, as AutoGPTQ, optimum and GPTQModel write them),
4- and 8-bit, repacked at load into the compiled kernel's layout (``repacked.py``).

``quantization_config``: ``bits`` (4, 8), ``group_size`` (-1: one scale per output channel),
``desc_act``, ``sym``, ``checkpoint_format`` (or ``format``: ``gptq``, the v1 layout, or
``gptq_v2``), ``pack_dtype`` (``int32``), ``lm_head`` (whether ``lm_head`` is quantized),
``modules_in_block_to_quantize`` (optimum's: only those modules of a block are). A quantized
module's tensors:

- ``qweight`` int32 [in·bits/32, out]: word ``i`` of column ``n`` holds input rows
  ``i·32/bits + j`` in bits ``bits·j``;
- ``qzeros`` int32 [G, out·bits/32], packed the same way along the output; v1 stores
  ``zero - 1`` (read as ``(stored + 1) & (2^bits - 1)``, as AutoGPTQ does), v2 the zero;
- ``scales`` float [G, out]; ``g_idx`` int32 [in]: each input row's group.

``W[n, k] = (q[k, n] - z[g_idx[k], n]) * s[g_idx[k], n]``. With ``desc_act`` (activation order)
``g_idx`` is a permutation of the groups: the input columns of the layer are reordered once at
load so that each group is contiguous (the kernel's grouped layout) and a call gathers the
activations' columns by the same order: a [T, in] gather per call instead of a per-weight
group lookup in the inner loop, and the kernel stays the one every int4 / int8 format runs.
Under tensor parallelism a rank's share of o / down holds columns of every group: it keeps
every group's ``scales`` / ``qzeros`` and is regrouped (``repacked.regroup``).
Refused, naming the field or tensor: other bit widths and checkpoint formats (``marlin``,
``bitblas``, v2's other pack dtypes), ``desc_act`` without ``g_idx``, a ``g_idx`` that is not a
grouping of ``group_size`` columns each, GPTQModel's per-module ``dynamic`` overrides.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from loramux.engine.errors import ModelLoadError
from loramux.engine.model.quant.base import Shape, Take, UnquantizedMethod
from loramux.engine.model.quant.repacked import ModulePart, RepackedMethod, act_order_perm, regroup

FORMATS = ("gptq", "gptq_v2")
"""``checkpoint_format`` values served: v1 (zeros stored minus one) and v2."""


def unpack_rows(packed: torch.Tensor, num_bits: int) -> torch.Tensor:
    """GPTQ words [w, n] packing along dim 0 → the unsigned values [w·32/bits, n]."""
    shifts = torch.arange(0, 32, num_bits, dtype=torch.int32, device=packed.device)  # [p]
    v = (packed.unsqueeze(1) >> shifts.view(1, -1, 1)) & ((1 << num_bits) - 1)  # [w, p, n]
    return v.reshape(-1, packed.shape[1])


def _refuse(source: str, field: str, value: Any, why: str) -> ModelLoadError:
    return ModelLoadError(f"{source}: quantization_config.{field} = {value!r}: {why}")


class GPTQMethod(RepackedMethod):
    """GPTQ 4- / 8-bit weights, run by the weight-only int4 / int8 kernel."""

    name = "gptq"

    def __init__(self, qc: Mapping[str, Any], source: str) -> None:
        super().__init__()
        self.source = source
        bits, group = qc.get("bits"), qc.get("group_size", -1)
        fmt = qc.get("checkpoint_format", qc.get("format", "gptq"))
        checks = (
            ("bits", bits in (4, 8), "supported: 4, 8"),
            ("group_size", isinstance(group, int) and (group == -1 or group > 0),
             "a positive integer or -1 is required"),
            ("checkpoint_format", fmt in FORMATS, f"supported: {', '.join(FORMATS)}"),
            ("is_marlin_format", not qc.get("is_marlin_format"), "the Marlin layout is not served"),
            ("pack_dtype", qc.get("pack_dtype", "int32") == "int32", "supported: int32"),
            ("dynamic", not qc.get("dynamic"), "per-module overrides are not supported"),
        )
        for field, ok, why in checks:
            if not ok:
                raise _refuse(source, field, qc.get(field, fmt if field == "checkpoint_format"
                                                    else None), why)
        self.num_bits, self.group_size = bits, (None if group == -1 else group)
        self.v1 = fmt == "gptq"
        self.desc_act, self.sym = bool(qc.get("desc_act", False)), bool(qc.get("sym", True))
        self.lm_head = bool(qc.get("lm_head", False))
        blocks = qc.get("modules_in_block_to_quantize")
        self.only = (tuple(m for block in blocks for m in (block if isinstance(block, list) else [block]))
                     if blocks else None)

    def describe(self) -> str:
        group = f"group {self.group_size}" if self.group_size else "per-channel"
        order = " desc_act" if self.desc_act else ""
        return (f"gptq{'' if self.v1 else ' v2'} int{self.num_bits} {group}"
                f"{' sym' if self.sym else ''}{order}")

    def quantized_module(self, module: str) -> bool:
        """Whether canonical module ``module`` is stored as ``qweight``."""
        if module.rsplit(".", 1)[-1] == "lm_head":
            return self.lm_head
        return self.only is None or any(module.endswith("." + m) for m in self.only)

    def create_linear(self, modules: Sequence[str], take: Take, bias: torch.Tensor | None, *,
                      shapes: Sequence[Shape], dtype: torch.dtype):
        kinds = {self.quantized_module(m) for m in modules}
        if len(kinds) > 1:
            raise ModelLoadError(f"{self.source}: modules {list(modules)} run fused; "
                                 "modules_in_block_to_quantize must name all of them or none")
        if not kinds.pop():
            return UnquantizedMethod().create_linear(modules, take, bias, shapes=shapes, dtype=dtype)
        parts = [self._read(m, shape, take) for m, shape in zip(modules, shapes, strict=True)]
        return self.build(parts, bias, dtype, self.num_bits, self.group_size, parts[0].scale.device)

    def _read(self, module: str, shape: Shape, take: Take) -> ModulePart:
        """One module's ``qweight`` / ``qzeros`` / ``scales`` / ``g_idx``, checked against
        each other, the config and the model's shape."""
        p, bits = module + ".", self.num_bits
        per = 32 // bits
        qweight, qzeros, scales = take(p + "qweight"), take(p + "qzeros"), take(p + "scales")
        g_idx = take(p + "g_idx") if self.desc_act else take(p + "g_idx", None)
        if qweight.dtype != torch.int32 or qweight.dim() != 2:
            raise self._bad(p + "qweight", f"is {qweight.dtype} {list(qweight.shape)}; int32 "
                            f"[in / {per}, out] is required")
        k, out = qweight.shape[0] * per, qweight.shape[1]
        if shape is not None and (out, k) != tuple(shape):
            raise self._bad(p + "qweight", f"is {list(qweight.shape)}; the model's config makes "
                            f"this weight [out, in] = {list(shape)}, packed to int32 "
                            f"[{shape[1] / per:g}, {shape[0]}]")
        g = self.group_size or k
        if (g_idx is not None and self.group_size and self.tensor_parallel_size > 1 and scales.dim() == 2
                and scales.shape[0] * g == k * self.tensor_parallel_size):
            return self._read_share(p, qweight, qzeros, scales, g_idx, k, out)
        if k % g:
            raise self._bad(p + "scales", f"group_size {g} does not divide the {k} input features")
        groups = k // g
        if not scales.is_floating_point() or tuple(scales.shape) != (groups, out):
            raise self._bad(p + "scales", f"is {scales.dtype} {list(scales.shape)}; a float "
                            f"[{groups}, {out}] is required")
        if not bool(torch.isfinite(scales).all()):
            raise self._bad(p + "scales", "holds non-finite values")
        self._check_zeros(p, qzeros, groups, out)
        perm = act_order_perm(g_idx, self.group_size, k, p + "g_idx", self.source) \
            if g_idx is not None else None
        return ModulePart(self._reader(qweight), out, k, scales.T.contiguous(),
                          self._zeros(qzeros).T.contiguous(), perm)

    def _read_share(self, p: str, qweight, qzeros, scales, g_idx, k: int, out: int) -> ModulePart:
        """A tensor-parallel share (``k`` of the input columns) of a projection under activation
        order: every group's ``scales`` / ``qzeros``, ``g_idx`` naming the share's columns'
        global groups (``TensorShard.settle``); regrouped for the kernel (``repacked.regroup``)."""
        groups = scales.shape[0]
        if not scales.is_floating_point() or scales.dim() != 2 or scales.shape[1] != out:
            raise self._bad(p + "scales", f"is {scales.dtype} {list(scales.shape)}; a float "
                            f"[groups, {out}] is required")
        if not bool(torch.isfinite(scales).all()):
            raise self._bad(p + "scales", "holds non-finite values")
        self._check_zeros(p, qzeros, groups, out)
        gi = g_idx.to(torch.int64)
        if tuple(gi.shape) != (k,) or g_idx.is_floating_point() or bool(((gi < 0) | (gi >= groups)).any()):
            raise self._bad(p + "g_idx", f"is {g_idx.dtype} {list(g_idx.shape)}; integers in "
                            f"0..{groups - 1} for the share's {k} input columns are required")
        if bool((torch.bincount(gi, minlength=groups) > self.group_size).any()):
            raise self._bad(p + "g_idx", f"gives a group more than group_size {self.group_size} columns")
        return regroup(self._reader(qweight), out, k, scales.T.contiguous(),
                       self._zeros(qzeros).T.contiguous(), gi, self.group_size, self.num_bits)

    def _check_zeros(self, p: str, qzeros, groups: int, out: int) -> None:
        per = 32 // self.num_bits
        if out % per or qzeros.dtype != torch.int32 or tuple(qzeros.shape) != (groups, out // per):
            raise self._bad(p + "qzeros", f"is {qzeros.dtype} {list(qzeros.shape)}; int32 "
                            f"[{groups}, {out / per:g}] is required")

    def _zeros(self, qzeros) -> torch.Tensor:
        """The zero points [G, out] (unsigned), as the checkpoint's format stores them."""
        bits = self.num_bits
        zero = unpack_rows(qzeros.T.contiguous(), bits).T
        return (zero + 1) & ((1 << bits) - 1) if self.v1 else zero

    def _reader(self, qweight):
        def read(r0: int, r1: int) -> torch.Tensor:  # output rows r0:r1 → [r, in]
            return unpack_rows(qweight[:, r0:r1], self.num_bits).T

        return read

    def _bad(self, tensor: str, why: str) -> ModelLoadError:
        return ModelLoadError(f"{self.source}: tensor {tensor} {why}")


METHOD = GPTQMethod
"""The method class ``select.quant_method`` builds for ``quant_method: gptq``."""
