"""Weight-only formats whose checkpoint layout is repacked once at load into the compiled
kernel's (``int_packed.kernel_layout``): AWQ and GPTQ. A format reads each module's unsigned
integer values a band of output rows at a time, its scales [out, G] and zero points [out, G]
(unsigned, None: the midpoint ``2^(bits-1)``, i.e. symmetric) and, for GPTQ's activation order,
a permutation of the input columns that makes every group contiguous; this module turns them
into the kernel's tensors and runs them.

A layer's ``params``: ``kernel_weight`` / ``kernel_scale`` / ``kernel_zero`` (the kernel's
layout; ``kernel_zero`` only when some zero point is off the midpoint) and ``perm``, int64
[P, in], when the columns are permuted: the kernel's column ``j`` of the rows of part ``p``
is the checkpoint's input column ``perm[p, j]``; the parts are output-row ranges
(:attr:`RepackedScheme.bounds`, one per fused module whose permutation differs). A call
gathers the activations' columns by ``perm`` (``[T, in]``, once per part), never the weights.
A tensor-parallel share of an activation-order layer (:func:`regroup`) has more kernel columns
than inputs (groups padded to whole sub-groups): ``perm`` is then [1, kernel in] and
:attr:`RepackedScheme.kernel_in` says how many.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from loramux.engine.errors import ModelLoadError
from loramux.engine.model.kernels import loader
from loramux.engine.model.quant.base import QuantLinear, WeightOnlyMethod
from loramux.engine.model.quant.int_packed import (
    KernelCall,
    kernel_dequantize,
    kernel_fits,
    kernel_layout,
)

logger = logging.getLogger(__name__)

KERNEL_DTYPES = (torch.float32, torch.bfloat16)
"""Activation and output dtypes the compiled kernel takes (others run the torch path)."""
BAND_ELEMS = 1 << 20
"""Weights unpacked at once while repacking (4 MiB of int32)."""

RowReader = Callable[[int, int], torch.Tensor]
"""``read(start, stop)``: a module's output rows ``start:stop`` as unsigned integers, int32
[stop - start, in] in the checkpoint's input-column order."""


@dataclass(frozen=True)
class RepackedScheme:
    """How a repacked layer is stored."""

    num_bits: int
    group_size: int | None
    """Input features per scale (None: one per output channel)."""
    symmetric: bool
    """No ``kernel_zero``: every zero point is the midpoint."""
    bounds: tuple[int, ...] = ()
    """Output-row boundaries of the parts with their own column permutation ``(0, ..., out)``;
    empty when the columns are not permuted."""
    kernel_in: int | None = None
    """The kernel's input columns when they are not the layer's (a regrouped share,
    :func:`regroup`: padded groups); None: the layer's ``in_features``."""

    def describe(self) -> str:
        group = f"group {self.group_size}" if self.group_size else "per-channel"
        kind = "symmetric" if self.symmetric else "zero points"
        perm = ", activation order" if self.bounds else ""
        perm += ", regrouped share" if self.kernel_in else ""
        return f"int{self.num_bits} {group} {kind}{perm}"


@dataclass
class ModulePart:
    """One checkpoint module as its format read it (checked)."""

    read: RowReader
    out_features: int
    in_features: int
    scale: torch.Tensor  # [out, G] float
    zero: torch.Tensor | None  # [out, G] int32 unsigned, or None (the midpoint)
    perm: torch.Tensor | None  # [in] int64: the column order making groups contiguous, or None
    columns: torch.Tensor | None = None
    """A regrouped share (:func:`regroup`): the activations' column of each of the kernel's
    ``in_features`` columns (padding: column 0, its weights exactly zero); ``read`` then
    gives rows in the kernel's order and ``perm`` is None."""
    inputs: int | None = None
    """With ``columns``: the layer's input features (the activations' columns)."""
    group_size: int | None = None
    """With ``columns``: the kernel's group size (sub-groups of the checkpoint's groups)."""


def act_order_perm(g_idx: torch.Tensor, group_size: int | None, in_features: int,
                   name: str, source: str) -> torch.Tensor | None:
    """The column order sorting ``g_idx`` [in] (each input column's group) so that every
    group is a contiguous run of ``group_size`` columns; None when it already is (no
    activation order). Raises :class:`ModelLoadError` naming ``name`` when ``g_idx`` is not
    a grouping of that size."""
    groups = in_features // group_size if group_size else 1
    g = g_idx.to(torch.int64)
    if tuple(g.shape) != (in_features,) or g.is_floating_point():
        raise ModelLoadError(f"{source}: tensor {name} is {g_idx.dtype} {list(g_idx.shape)}; "
                             f"an integer [{in_features}] is required")
    if bool(((g < 0) | (g >= groups)).any()):
        raise ModelLoadError(f"{source}: tensor {name} holds groups outside 0..{groups - 1}")
    per = in_features // groups
    if bool((torch.bincount(g, minlength=groups) != per).any()):
        raise ModelLoadError(f"{source}: tensor {name} does not give every group {per} columns")
    if bool((g == torch.arange(in_features) // per).all()):
        return None
    return torch.argsort(g, stable=True)


def regroup(read: RowReader, out_features: int, in_features: int, scale: torch.Tensor,
            zero: torch.Tensor | None, g_idx: torch.Tensor, group_size: int, num_bits: int) -> ModulePart:
    """A tensor-parallel rank's share of a GPTQ projection under activation order: its
    ``in_features`` input columns belong to groups (``g_idx``, global) whose other columns
    sit on other ranks, so no group is whole here. The share's columns are sorted by group
    and each group's run padded to whole sub-groups of ``s`` columns (``s``: the candidate
    among 32, 64, ... up to the group size, or the group size, that stores the fewest bytes
    — weights plus a scale and zero point a sub-group), each sub-group with its group's
    scale and zero point; padding weights are the zero point (exactly 0 dequantized) and
    read activation column 0. ``scale`` / ``zero`` [out, G] cover every group."""
    g = g_idx.to(torch.int64)
    counts = torch.bincount(g, minlength=scale.shape[1])
    present = torch.nonzero(counts).flatten().tolist()
    candidates = sorted({c for c in range(32, group_size + 1, 32)} | {group_size})
    per_sub = (8 if zero is not None else 4) * 8 // num_bits  # a sub-group's scale (+ zero), in weights

    def cost(c: int) -> int:
        subs = sum(-(-int(counts[p]) // c) for p in present)
        return subs * c + subs * per_sub

    s = min(candidates, key=lambda c: (cost(c), -c))
    order = torch.argsort(g, stable=True)
    columns, parents, at = [], [], 0
    for p in present:
        n = int(counts[p])
        subs = -(-n // s)
        columns += order[at : at + n].tolist() + [-1] * (subs * s - n)
        parents += [p] * subs
        at += n
    cols = torch.tensor(columns, dtype=torch.int64)
    parent = torch.tensor(parents, dtype=torch.int64)
    pad = cols < 0
    pad_parent = parent.repeat_interleave(s)[pad]
    mid = 1 << (num_bits - 1)
    sub_zero = zero[:, parent] if zero is not None else None

    def read_regrouped(r0: int, r1: int) -> torch.Tensor:
        values = read(r0, r1)[:, cols.clamp_min(0)]
        values[:, pad] = zero[r0:r1][:, pad_parent] if zero is not None else mid
        return values

    return ModulePart(read_regrouped, out_features, len(columns), scale[:, parent].contiguous(),
                      sub_zero.contiguous() if sub_zero is not None else None, None,
                      columns=cols.clamp_min(0), inputs=in_features, group_size=s)


def _layout(part: ModulePart, num_bits: int, zero_needed: bool) -> dict[str, torch.Tensor]:
    """One module in the kernel's layout, a band of output rows at a time."""
    off = 1 << (num_bits - 1)  # unsigned → the kernel's signed values
    k = part.in_features
    step = max(8, BAND_ELEMS // k // 8 * 8)
    zero = part.zero
    if zero is None and zero_needed:
        zero = torch.full(part.scale.shape, off, dtype=torch.int32)
    bands = []
    for r0 in range(0, part.out_features, step):
        r1 = min(r0 + step, part.out_features)
        values = part.read(r0, r1).cpu()  # [r, in] unsigned
        if part.perm is not None:
            values = values[:, part.perm.cpu()]
        bands.append(kernel_layout(values - off, part.scale[r0:r1].cpu(),
                                   zero[r0:r1].cpu() - off if zero is not None else None, num_bits))
    return {name: torch.cat([b[name] for b in bands]) for name in bands[0]}


def repack(parts: Sequence[ModulePart], num_bits: int, group_size: int | None,
           device: torch.device) -> tuple[dict[str, torch.Tensor], RepackedScheme]:
    """The fused projection of ``parts`` (concatenated along the output rows) in the kernel's
    layout on ``device``, and its scheme."""
    mid = 1 << (num_bits - 1)
    for p in parts:  # zero points all at the midpoint: symmetric, no zero term in the kernel
        if p.zero is not None and bool((p.zero == mid).all()):
            p.zero = None
    zero_needed = any(p.zero is not None for p in parts)
    tensors = [_layout(p, num_bits, zero_needed) for p in parts]
    params = {name: torch.cat([t[name] for t in tensors]).to(device) for name in tensors[0]}
    bounds: tuple[int, ...] = ()
    perms = [p.columns if p.columns is not None else p.perm for p in parts]
    if any(p is not None for p in perms):
        k = parts[0].in_features
        kept: list[torch.Tensor] = []
        cuts, row = [0], 0
        for part, perm in zip(parts, perms, strict=True):
            perm = perm if perm is not None else torch.arange(k)
            row += part.out_features
            if kept and torch.equal(perm, kept[-1]):
                cuts[-1] = row  # the same order as the part before: one run
            else:
                kept.append(perm)
                cuts.append(row)
        bounds = tuple(cuts)  # part i: rows bounds[i]:bounds[i + 1]
        params["perm"] = torch.stack(kept).to(device)  # [P, in]
    kernel_in = parts[0].in_features if parts[0].columns is not None else None
    return params, RepackedScheme(num_bits, group_size, not zero_needed, bounds, kernel_in)


class RepackedMethod(WeightOnlyMethod):
    """A weight-only method whose layers hold the kernel's layout (``repack``): the compiled
    kernel runs them on the CPU; elsewhere (or without the kernels) a band of rows is
    dequantized at a time from the same tensors."""

    source: str = ""

    def __init__(self) -> None:
        self._logged: set[tuple[RepackedScheme, str]] = set()

    def build(self, parts: Sequence[ModulePart], bias: torch.Tensor | None, dtype: torch.dtype,
              num_bits: int, group_size: int | None, device: torch.device) -> QuantLinear:
        """The :class:`QuantLinear` of a fused projection read as ``parts``."""
        in_features = {p.inputs or p.in_features for p in parts}
        if len(in_features) > 1 or (parts[0].columns is not None and len(parts) > 1):
            raise ModelLoadError(f"{self.source}: fused modules have different input features "
                                 f"{sorted(in_features)}")
        group_size = parts[0].group_size or group_size
        params, scheme = repack(parts, num_bits, group_size, device)
        self._log(scheme, device)
        return QuantLinear(self, params, bias, out_features=sum(p.out_features for p in parts),
                           in_features=in_features.pop(), dtype=dtype, scheme=scheme)

    def _log(self, scheme: RepackedScheme, device: torch.device) -> None:
        """Logs once per scheme which path its layers run."""
        why = (f"CPU kernels {loader.status().state}" if not loader.available()
               else None if kernel_fits(scheme.group_size)
               else f"group size {scheme.group_size} is not a multiple of 32")
        note = (f"{device.type}: WeightOnlyMethod.apply's device path (Triton where it runs this "
                "layer, else torch bands)" if device.type != "cpu"
                else f"torch dequantize-then-matmul ({why})" if why
                else f"loramux::wq_linear ({loader.status().isa} variant)")
        if (scheme, note) not in self._logged:
            self._logged.add((scheme, note))
            logger.info("%s linears (%s): %s", self.name, scheme.describe(), note)

    def keeps_stored_dtype(self, name: str) -> bool:
        return name.rsplit(".", 1)[-1] in ("qweight", "qzeros", "scales", "g_idx")

    def apply(self, layer: QuantLinear, x: torch.Tensor) -> torch.Tensor:
        """The compiled kernel (per part, the activations' columns gathered by ``perm``)
        where it runs this layer; else the torch path."""
        scheme: RepackedScheme = layer.scheme
        if not (x.device.type == "cpu" and loader.available() and kernel_fits(scheme.group_size)
                and x.dtype in KERNEL_DTYPES and layer.dtype in KERNEL_DTYPES):
            return super().apply(layer, x)
        if layer.kernel_calls is None:
            layer.kernel_calls = self._kernel_calls(layer)
        return layer.call_kernels(x)

    @staticmethod
    def _kernel_calls(layer: QuantLinear) -> list:
        """The layer's kernel calls, bound once: one, or one per part with the columns its
        activations are gathered by (``perm``)."""
        scheme: RepackedScheme = layer.scheme
        p = layer.params

        def bind(params: dict, bias: torch.Tensor | None) -> KernelCall:
            return KernelCall(params, scheme.num_bits, layer.kernel_in_features, scheme.group_size,
                              bias, layer.dtype)

        if "perm" not in p:
            return [(None, bind(p, layer.bias))]
        calls = []
        for i, perm in enumerate(p["perm"]):
            r0, r1 = scheme.bounds[i], scheme.bounds[i + 1]
            part = {k: v[r0:r1] for k, v in p.items() if k != "perm"}
            calls.append((perm, bind(part, layer.bias[r0:r1] if layer.bias is not None else None)))
        return calls

    def dequantize_rows(self, layer: QuantLinear, start: int, stop: int) -> torch.Tensor:
        """Rows ``start:stop`` in the checkpoint's input-column order, float32."""
        scheme: RepackedScheme = layer.scheme
        w = kernel_dequantize(layer.params, scheme.num_bits, layer.kernel_in_features,
                              scheme.group_size, start, stop)  # [r, kernel in], kernel column order
        return layer.checkpoint_columns(w, start)
