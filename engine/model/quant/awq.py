"""AWQ checkpoints (``quant_method: "awq"``) in AutoAWQ's GEMM layout, repacked at load into
the compiled kernel's layout (``repacked.py``): the weights stay 4-bit in memory.

``quantization_config``: ``bits`` (4), ``group_size`` (input features per scale; -1: one per
output channel), ``zero_point``, ``version`` (``gemm``), ``modules_to_not_convert`` (a module
whose name contains one of them is a plain float ``.weight``; ``lm_head`` always is). A
quantized module's tensors, as AutoAWQ's ``WQLinear_GEMM`` writes them:

- ``qweight`` int32 [in, out / 8]: each word holds 8 output columns of one input row, column
  ``8c + order[i]`` in bits ``4i`` with ``order = [0, 2, 4, 6, 1, 3, 5, 7]``;
- ``qzeros`` int32 [in / group, out / 8], the same packing, unsigned zero points;
- ``scales`` float [in / group, out].

``W[n, k] = (q[k, n] - z[k // group, n]) * s[k // group, n]``. With ``zero_point: false``
``qzeros`` is read when present; without it the zero point is 8 (the symmetric ``uint4b8``).
Refused, naming the field: other versions (``gemv``, ``exllama``, ``marlin``, ``ipex``), other
bit widths, a group size not dividing the input features.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from loramux.engine.errors import ModelLoadError
from loramux.engine.model.quant.base import Shape, Take, UnquantizedMethod
from loramux.engine.model.quant.repacked import ModulePart, RepackedMethod

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
"""AutoAWQ's packing order: the value of column ``8c + AWQ_ORDER[i]`` is in bits ``4i`` of
word ``c``."""
AWQ_REVERSE = tuple(AWQ_ORDER.index(j) for j in range(8))
"""Which nibble holds column ``8c + j``: ``(0, 4, 1, 5, 2, 6, 3, 7)``."""


def unpack_awq(packed: torch.Tensor) -> torch.Tensor:
    """AutoAWQ-packed words [n, c] → the unsigned 4-bit values [n, 8c] in column order."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)  # [8] nibbles
    v = (packed.unsqueeze(-1) >> shifts) & 15  # [n, c, 8] in nibble order
    v = v[..., list(AWQ_REVERSE)]  # [n, c, 8] in column order
    return v.reshape(packed.shape[0], -1)


def _refuse(source: str, field: str, value: Any, why: str) -> ModelLoadError:
    return ModelLoadError(f"{source}: quantization_config.{field} = {value!r}: {why}")


class AWQMethod(RepackedMethod):
    """AutoAWQ GEMM 4-bit weights, run by the weight-only int4 kernel."""

    name = "awq"

    def __init__(self, qc: Mapping[str, Any], source: str) -> None:
        super().__init__()
        self.source = source
        bits, group = qc.get("bits", qc.get("w_bit")), qc.get("group_size", qc.get("q_group_size"))
        version = str(qc.get("version", "gemm")).lower()
        if bits != 4:
            raise _refuse(source, "bits", bits, "AWQ is served with 4-bit weights only")
        if not isinstance(group, int) or not (group == -1 or group > 0):
            raise _refuse(source, "group_size", group, "a positive integer or -1 is required")
        if version != "gemm":
            raise _refuse(source, "version", qc.get("version"), "supported: gemm (AutoAWQ's "
                          "WQLinear_GEMM layout)")
        skip = qc.get("modules_to_not_convert") or []
        if not isinstance(skip, list) or not all(isinstance(m, str) for m in skip):
            raise _refuse(source, "modules_to_not_convert", skip, "a list of module names is required")
        self.num_bits, self.group_size = 4, (None if group == -1 else group)
        self.zero_point = bool(qc.get("zero_point", True))
        self.skip = tuple(skip)

    def describe(self) -> str:
        group = f"group {self.group_size}" if self.group_size else "per-channel"
        zp = "zero points" if self.zero_point else "symmetric"
        return f"awq gemm int4 {group} {zp} (not converted: {list(self.skip)})"

    def quantized_module(self, module: str) -> bool:
        """Whether canonical module ``module`` is stored as ``qweight`` (AutoAWQ never quantizes
        ``lm_head``; ``modules_to_not_convert`` entries match as substrings, as AutoAWQ does)."""
        return module.rsplit(".", 1)[-1] != "lm_head" and not any(s in module for s in self.skip)

    def create_linear(self, modules: Sequence[str], take: Take, bias: torch.Tensor | None, *,
                      shapes: Sequence[Shape], dtype: torch.dtype):
        kinds = {self.quantized_module(m) for m in modules}
        if len(kinds) > 1:
            raise ModelLoadError(f"{self.source}: modules {list(modules)} run fused; "
                                 "modules_to_not_convert must name all of them or none")
        if not kinds.pop():
            return UnquantizedMethod().create_linear(modules, take, bias, shapes=shapes, dtype=dtype)
        parts = [self._read(m, shape, take) for m, shape in zip(modules, shapes, strict=True)]
        device = parts[0].scale.device
        return self.build(parts, bias, dtype, self.num_bits, self.group_size, device)

    def _read(self, module: str, shape: Shape, take: Take) -> ModulePart:
        """One module's ``qweight`` / ``qzeros`` / ``scales``, checked against each other,
        the config's group size and the model's shape."""
        p = module + "."
        qweight, scales = take(p + "qweight"), take(p + "scales")
        qzeros = take(p + "qzeros") if self.zero_point else take(p + "qzeros", None)
        if qweight.dtype != torch.int32 or qweight.dim() != 2:
            raise self._bad(p + "qweight", f"is {qweight.dtype} {list(qweight.shape)}; int32 "
                            "[in, out / 8] is required")
        k, out = qweight.shape[0], qweight.shape[1] * 8
        if shape is not None and (out, k) != tuple(shape):
            raise self._bad(p + "qweight", f"is [{k}, {qweight.shape[1]}]; the model's config "
                            f"makes this weight [out, in] = {list(shape)}, packed to int32 "
                            f"[{shape[1]}, {shape[0] // 8}]")
        g = self.group_size or k
        if k % g:
            raise self._bad(p + "scales", f"group_size {g} does not divide the {k} input features")
        want = (k // g, out)
        if not scales.is_floating_point() or tuple(scales.shape) != want:
            raise self._bad(p + "scales", f"is {scales.dtype} {list(scales.shape)}; a float "
                            f"{list(want)} is required")
        if not bool(torch.isfinite(scales).all()):
            raise self._bad(p + "scales", "holds non-finite values")
        zero = None
        if qzeros is not None:
            if qzeros.dtype != torch.int32 or tuple(qzeros.shape) != (want[0], out // 8):
                raise self._bad(p + "qzeros", f"is {qzeros.dtype} {list(qzeros.shape)}; int32 "
                                f"[{want[0]}, {out // 8}] is required")
            zero = unpack_awq(qzeros).T.contiguous()  # [out, G]

        def read(r0: int, r1: int) -> torch.Tensor:  # rows r0:r1, multiples of 8 → [r, in]
            return unpack_awq(qweight[:, r0 // 8:r1 // 8]).T

        return ModulePart(read, out, k, scales.T.contiguous(), zero, None)

    def _bad(self, tensor: str, why: str) -> ModelLoadError:
        return ModelLoadError(f"{self.source}: tensor {tensor} {why}")


METHOD = AWQMethod
"""The method class ``select.quant_method`` builds for ``quant_method: awq``."""
