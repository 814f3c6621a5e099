"""DoRA in the one batched path: a per-row scale after each projection.

A DoRA module's weight is ``W' = m ⊙ (W0 + s·BA) / ‖W0 + s·BA‖`` (the norm per output row,
treated as a constant as PEFT's ``DoraLinearLayer`` does), so with the base bias ``b`` a
token's output is ``g ⊙ (x W0ᵀ + s·x Aᵀ Bᵀ) + b`` with ``g = m / ‖W0 + s·BA‖``: a vector per
adapter and module, computed once when the adapter is loaded (:func:`dora_scales`). The
base GEMM stays shared by every row (its output already holds ``b``), the LoRA kernels add
the delta as for any adapter, and then a DoRA row becomes ``g ⊙ y + c`` with the bias
correction ``c = (1 - g) ⊙ b``, computed as ``y + y ⊙ (g - 1) + c`` (the slots keep ``g - 1``,
whose small learned deviations survive bfloat16); every other row is left alone
(:class:`DoraStep`).

``‖W0 + s·BA‖²`` per row is ``‖W0‖² + 2s·Σ_r B (A W0ᵀ)ᵀ + s²·‖BA‖²``: the base's row norms
(kept by :class:`~loramux.engine.model.linear.Linear`, whose packed weight cannot be read
back) and one small projection of A's rows through the base, in float64 from float32 parts.
Under tensor parallelism each rank computes these sums over its share (its rows of a
column-parallel projection, its input columns of a row-parallel one, whose sums the ranks
add up) and rank 0 joins them into the whole adapter's scales at load.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from loramux.adapters.arch import FUSED_MODULES, GROUP_OF, PROJECTION_GROUPS
from loramux.adapters.format import LoraWeights
from loramux.engine.errors import LoRAError
from loramux.engine.model.linear import Linear
from loramux.engine.model.quant.base import QuantLinear

MAX_DORA_SCALE = 1e4
"""Largest |g| served: a row whose ``‖W0 + s·BA‖`` is ~0 against its magnitude overflows
every layer after it, so the adapter is refused at load."""
SLICE_RUNS = 1
"""Steps with at most this many short runs of DoRA rows scale each run's rows as one slice;
more gather a per-token scale over the span that holds them (two ops per projection: on the
CPU one bf16 op on a slice costs about what the gather and op on 16 rows do)."""
PREGATHER_TOKENS = 64
"""Spans of at most this many tokens gather their rows' gains for every layer at once, one
op per group and step (``[layers, tokens, N]``), instead of one per projection."""
LONG_RUN = 16
"""Runs of at least this many tokens (prefill chunks) are always scaled as one slice: the
gather would copy their scale row once per token (~30% more time on the CPU)."""


class BaseProjections:
    """The served base's projections, by layer and projection group (what DoRA reads); under
    tensor parallelism, this rank's share of them."""

    def __init__(self, model) -> None:
        """``model``: the engine's ``DecoderModel``."""
        self.model = model
        self.shard = getattr(model, "shard", None)
        """This rank's share (``TensorShard``) under tensor parallelism, else None."""
        self.gather: Callable[[LoraWeights, Callable[[], RankParts]], list[RankParts]] | None = None
        """Rank 0 under tensor parallelism: ``(whole adapter, a function computing this rank's
        parts)`` → every rank's parts, rank 0's first (the runner's exchange with its workers,
        which compute theirs while rank 0 computes its own)."""
        self.slice_offsets = getattr(model, "local_dims", model.dims).group_offsets()

    def linear(self, layer: int, group: str) -> Linear | QuantLinear:
        weights = self.model.layers[layer]
        lin = weights.qkv if group == "qkv" else weights.o if group == "o" else getattr(
            weights.mlp, group, None)
        if not isinstance(lin, (Linear, QuantLinear)):
            raise LoRAError(f"DoRA on {group} of layer {layer}: this model's layer has no dense "
                            f"{group} projection")
        return lin

    def parts(self, weights: LoraWeights) -> RankParts:
        """This rank's :data:`RankParts` of the whole DoRA adapter ``weights`` (cut to this
        rank's share first under tensor parallelism)."""
        return rank_parts(weights if self.shard is None else self.shard.lora(weights), self)

    def rows(self, group: str, module: str) -> slice:
        """The rows of ``module`` in its group's projection (all of them for a fused name)."""
        offs = self.slice_offsets[group]
        if module in FUSED_MODULES or len(offs) == 2:
            return slice(0, offs[-1])
        s = PROJECTION_GROUPS[group].index(module)
        return slice(offs[s], offs[s + 1])


RankParts = dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor | None]]
"""Per ``(layer, module)`` of a DoRA adapter, what one rank's share of the base gives:
``‖W0 + s·BA‖²`` of the rows it holds (float64; a partial sum over its input columns for a
row-parallel projection) and the base bias of those rows (None: no bias on this rank)."""


def module_norm_sq(lin: Linear | QuantLinear, rows: slice, a: torch.Tensor, b: torch.Tensor,
                   scale: float) -> torch.Tensor:
    """``‖W0 + s·BA‖²`` per row of the module (``rows`` of ``lin``), float64 [out] on the CPU,
    summed over the input columns ``lin`` and ``a`` hold (all of them on one process)."""
    base_rows = lin.project(a)[:, rows].double().cpu()  # [r, out] = A W0ᵀ
    norms_sq = lin.row_norms()[rows].double().cpu() ** 2
    a64, b64 = a.double().cpu(), b.double().cpu()
    ba_sq = ((b64 @ (a64 @ a64.T)) * b64).sum(1)  # ‖B A‖² per row
    cross = (b64 * base_rows.T).sum(1)  # W0 · (BA) per row
    return norms_sq + 2 * scale * cross + scale * scale * ba_sq


def row_gains(norm_sq: torch.Tensor, m: torch.Tensor, bias: torch.Tensor | None
              ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(g, c)`` float32 [out]: ``g = m / ‖W0 + s·BA‖`` from the rows' squared norms,
    ``c = (1 - g) ⊙ bias`` (None without a bias)."""
    g = (m.double().cpu() / norm_sq.clamp_min(0).sqrt()).float()
    c = None if bias is None else ((1 - g.double()) * bias.double().cpu()).float()
    return g, c


def rank_parts(weights: LoraWeights, base: BaseProjections) -> RankParts:
    """This rank's :data:`RankParts` of a DoRA adapter (``weights``: this rank's share of it)."""
    parts: RankParts = {}
    with torch.no_grad():
        for layer, modules in sorted(weights.layers.items()):
            for module, (a, b) in modules.items():
                group = GROUP_OF[module]
                lin, rows = base.linear(layer, group), base.rows(group, module)
                bias = lin.bias[rows].double().cpu() if lin.bias is not None else None
                parts[(layer, module)] = (module_norm_sq(lin, rows, a, b, weights.spec.scale), bias)
    return parts


def dora_scales(weights: LoraWeights, base: BaseProjections, name: str = "adapter") -> None:
    """Fill ``weights.dora_scales`` (the whole adapter's) for a DoRA adapter against the served
    base; under tensor parallelism every rank computes its share's parts and rank 0 joins them
    (``TensorShard.join_dora``: a row-parallel row's squared norm is the sum of the ranks'
    partial sums). Raises :class:`LoRAError` naming the module when a scale is not finite or
    above :data:`MAX_DORA_SCALE`."""
    for layer, modules in sorted(weights.layers.items()):
        for module in modules:
            if weights.magnitudes.get(layer, {}).get(module) is None:
                raise LoRAError(f"DoRA adapter {name!r}: layer {layer} {module} has no "
                                f"lora_magnitude_vector")
    if base.shard is not None and base.gather is None:
        raise LoRAError(f"DoRA adapter {name!r}: this rank cannot reach the other ranks' "
                        f"shares of the base")
    if base.shard is None:
        parts = base.parts(weights)
    else:
        parts = base.shard.join_dora(base.gather(weights, lambda: base.parts(weights)))
    scales: dict[int, dict[str, tuple[torch.Tensor, torch.Tensor | None]]] = {}
    for (layer, module), (norm_sq, bias) in parts.items():
        g, c = row_gains(norm_sq, weights.magnitudes[layer][module], bias)
        peak = float(g.abs().max()) if g.numel() else 0.0
        if not peak <= MAX_DORA_SCALE:
            raise LoRAError(
                f"DoRA adapter {name!r}: layer {layer} {module} scales its rows by up to "
                f"{peak:.3g} (magnitude / ‖W0 + s·BA‖; limit {MAX_DORA_SCALE:g}): its "
                f"weight's rows nearly cancel the base's")
        scales.setdefault(layer, {})[module] = (g, c)
    weights.dora_scales = scales


class DoraStep:
    """One step's DoRA rows and the per-row scale every projection applies after its LoRA
    delta (built by ``LoRAStepBatch.prepare`` when the step has a DoRA row)."""

    def __init__(self, runs, buffers, device, *, triton: bool = False) -> None:
        """``runs``: the step's ``(first token, end token, slot)`` runs with a DoRA slot;
        ``triton``: scale with the Triton kernel (``ops/triton_dora.py``: one launch per
        projection over the span, other rows skipped) instead of torch ops."""
        self.buffers = buffers
        self.cells = frozenset().union(*(buffers.dora[slot] for _, _, slot in runs))
        """The ``(layer, group)`` pairs some row of the step scales."""
        self.span = None
        self.kernel = None
        if triton:
            from loramux.engine.lora.ops.triton_dora import dora_scale_rows

            self.kernel = dora_scale_rows
        short = runs if self.kernel is not None else [r for r in runs if r[1] - r[0] < LONG_RUN]
        self.runs = runs
        """The runs scaled one slice each (the others lie in the span)."""
        if len(short) > SLICE_RUNS or self.kernel is not None:
            lo, hi = short[0][0], short[-1][1]
            rows = torch.full((hi - lo,), buffers.max_loras, dtype=torch.int64)  # the zero row
            for start, end, slot in short:
                rows[start - lo : end - lo] = slot
            self.span = (lo, hi, rows.to(device))
            self.runs = [r for r in runs if r not in short]
        self._gathered: dict[str, torch.Tensor] = {}
        self._pregather = (self.kernel is None and self.span is not None
                           and self.span[1] - self.span[0] <= PREGATHER_TOKENS
                           and getattr(buffers, "row_gain_stack", None) is not None)

    def apply(self, layer: int, group: str, y: torch.Tensor) -> None:
        """``y = g ⊙ y + c`` (as ``y + y ⊙ (g - 1) + c``) on this step's DoRA rows of ``group``
        in ``layer``."""
        if (layer, group) not in self.cells:
            return
        gain = self.buffers.row_gain[layer][group]
        c_all = self.buffers.row_shift.get((layer, group))
        if self.kernel is not None:
            lo, hi, rows = self.span
            self.kernel(y[lo:hi], gain, c_all, rows, self.buffers.max_loras)
            return
        if self.span is not None:
            lo, hi, rows = self.span
            view = y[lo:hi]
            if self._pregather:
                gathered = self._gathered.get(group)
                if gathered is None:
                    gathered = self.buffers.row_gain_stack[group].index_select(1, rows)
                    self._gathered[group] = gathered
                view.addcmul_(view, gathered[layer])
            else:
                view.addcmul_(view, gain.index_select(0, rows))
            if c_all is not None:
                view.add_(c_all.index_select(0, rows))
        for start, end, slot in self.runs:
            if (layer, group) in self.buffers.dora[slot]:
                view = y[start:end]
                view.addcmul_(view, gain[slot])
                if c_all is not None:
                    view.add_(c_all[slot])
