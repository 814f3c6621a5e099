"""Mixture-of-experts feed-forward blocks (Qwen3-MoE, Mixtral): the router and the batched
experts path.

The router is transformers': ``softmax(x @ W_r.T)`` in float32, ``torch.topk`` of the
probabilities (its tie order too: the logits are computed with the same plain matmul),
renormalised over the top-k when ``norm_topk_prob`` (Mixtral always). The experts run
batched: the (token, expert) pairs are sorted by expert (a stable sort, so each expert's rows
keep token order), each expert that got rows runs one gate|up GEMM, the gated activation and
one down GEMM over its contiguous run, the rows are scaled by their routing weights and
summed back into their tokens with one ``index_add_``. Work is proportional to tokens × top-k.
On CUDA each projection is one Triton grouped-GEMM launch over all experts' runs
(``triton_moe.py``) on the stacked weights; on the CPU each expert is a oneDNN-packed
``Linear``.

An expert LoRA (``ExpertLoRAHook.add_experts``) adds each row's delta from its token's
adapter and the row's expert, over the same sorted runs.

Checkpoints: the fused 3-D tensors transformers 5 keeps in memory (``mlp.experts.gate_up_proj``
[E, 2I, H], ``mlp.experts.down_proj`` [E, H, I]) or the per-expert tensors checkpoints are
saved with (``<parent>.experts.<e>.<gate|up|down>.weight``, named by the family's
:class:`ExpertNames`, which its module passes to :func:`load_moe_block`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from loramux.engine.errors import ModelLoadError
from loramux.engine.model.linear import Linear
from loramux.engine.model.spec import LayerContext


@dataclass(frozen=True)
class ExpertNames:
    """How a family's checkpoints name its MoE block and one expert's projections (each MoE
    family's module has its own)."""

    parents: tuple[str, ...]
    """The block's module names, first match wins (``mlp``; Mixtral's older ``block_sparse_moe``)."""
    gate: str
    up: str
    down: str


class ExpertLoRAHook(Protocol):
    """What the LoRA hook offers an MoE block (``engine/lora/experts.py``)."""

    def experts_active(self, layer: int) -> bool:
        """True when this step has tokens whose adapter targets ``layer``'s experts."""

    def add_router(self, layer: int, x: torch.Tensor, logits: torch.Tensor) -> None:
        """``logits [T, E] +=`` each token's adapter's router LoRA delta for x [T, H]."""

    def add_experts(self, layer: int, group: str, x: torch.Tensor, y: torch.Tensor,
                    tokens: torch.Tensor, counts: list[int]) -> None:
        """``y[j] +=`` the expert delta of row j (token ``tokens[j]``, routed to the expert of
        its run: rows are sorted by expert, ``counts[e]`` rows for expert e) for input x[j];
        ``group``: ``gate_up`` or ``down``."""


class MoEBlock:
    """A sparse MoE feed-forward block: ``sum_k w_k * down_e(act(gate_up_e(x)))`` over each
    token's top-k experts."""

    def __init__(self, router: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                 top_k: int, norm_topk_prob: bool, act: Callable, *, weights_in_float: bool,
                 backend: str = "torch") -> None:
        """``gate_up`` [E, 2I, H], ``down`` [E, H, I] — or lists of E projections a quantized
        checkpoint's method made (``QuantLinear``; run one expert at a time, any device);
        ``backend``: ``torch`` (one packed ``Linear`` per expert, the CPU) or ``triton`` (the
        stacked weights and one grouped GEMM launch per projection, ``triton_moe.py``: CUDA)."""
        self.router = router  # [E, H] model dtype (plain: the matmul transformers runs)
        self.backend = backend
        if isinstance(gate_up, list):  # per-expert projections made by the quantization method
            self.stacked, self.gate_up, self.down = None, gate_up, down
        elif backend == "triton":
            self.stacked = (gate_up.contiguous(), down.contiguous())
            self.gate_up = self.down = None
        else:
            self.stacked = None
            self.gate_up = [Linear(w.contiguous()) for w in gate_up.unbind(0)]  # E x [2 I, H]
            self.down = [Linear(w.contiguous()) for w in down.unbind(0)]  # E x [H, I]
        self.num_experts = len(gate_up)
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        self.act = act
        self.weights_in_float = weights_in_float
        """Mixtral scales the experts' outputs by the float32 weights; Qwen3-MoE casts them to
        the model dtype first."""

    @property
    def linears(self) -> list[Linear]:
        if self.stacked is not None:
            return [Linear(self.router, pack=False), *(Linear(w.flatten(0, 1), pack=False) for w in self.stacked)]
        return [*self.gate_up, *self.down, Linear(self.router, pack=False)]

    def route(self, x: torch.Tensor, layer: int = 0, lora=None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(weights [T, k], experts [T, k])`` of each token, as transformers' router (with
        each token's adapter's router LoRA when ``lora`` has one)."""
        logits = F.linear(x.to(self.router.dtype), self.router)  # [T, E]
        if lora is not None:
            lora.add_router(layer, x, logits)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if not self.weights_in_float:
            weights = weights.to(logits.dtype)
        return weights, experts

    def __call__(self, x: torch.Tensor, layer: int, lora) -> torch.Tensor:
        expert_lora = lora if lora is not None and hasattr(lora, "experts_active") \
            and lora.experts_active(layer) else None
        weights, experts = self.route(x, layer, expert_lora)  # [T, k]
        k = self.top_k
        flat = experts.reshape(-1)  # [T k]
        order = torch.argsort(flat, stable=True)  # rows sorted by expert, token order within
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        tokens = order // k  # [T k] each row's token
        xs = x.index_select(0, tokens)  # [T k, H]
        gu = self._project(0, xs, counts)  # [T k, 2 I]
        if expert_lora is not None:
            expert_lora.add_experts(layer, "gate_up", xs, gu, tokens, counts)
        h = self.act(gu)  # [T k, I]
        out = self._project(1, h, counts)  # [T k, H]
        if expert_lora is not None:
            expert_lora.add_experts(layer, "down", h, out, tokens, counts)
        w = weights.reshape(-1).index_select(0, order).unsqueeze(1)  # [T k, 1]
        out = (out * w).to(x.dtype) if self.weights_in_float else out * w.to(out.dtype)
        y = torch.zeros(x.shape[0], out.shape[1], dtype=out.dtype, device=x.device)
        return y.index_add_(0, tokens, out)

    def _project(self, which: int, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Projection ``which`` (0: gate|up, 1: down) of every expert over its run of rows."""
        if self.stacked is not None:
            from loramux.engine.model.triton_moe import grouped_matmul

            return grouped_matmul(x, self.stacked[which], counts)
        return self._grouped(self.gate_up if which == 0 else self.down, x, counts)

    @staticmethod
    def _grouped(linears: list[Linear], x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Each expert's projection over its run of the expert-sorted rows x [R, K]."""
        out = None
        start = 0
        for e, c in enumerate(counts):
            if not c:
                continue
            part = linears[e](x[start:start + c])
            if out is None:
                out = x.new_empty(x.shape[0], part.shape[1], dtype=part.dtype)
            out[start:start + c] = part
            start += c
        return out


def _take_experts(take, prefix: str, parent: str, names: ExpertNames, num_experts: int):
    """``(gate_up [E, 2I, H], down [E, H, I])`` from either checkpoint layout, or None when
    ``parent`` holds neither."""
    p = f"{prefix}{parent}.experts."
    fused = take(p + "gate_up_proj", None)
    if fused is not None:
        down = take(p + "down_proj")
        if fused.dim() != 3 or down.dim() != 3 or fused.shape[0] != num_experts:
            raise ModelLoadError(f"{p}gate_up_proj: shape {list(fused.shape)}, expected "
                                 f"[{num_experts}, 2 * intermediate, hidden]")
        return fused, down
    first = take(f"{p}0.{names.gate}.weight", None)
    if first is None:
        return None
    gate_up, down = [], []
    for e in range(num_experts):
        gate = first if e == 0 else take(f"{p}{e}.{names.gate}.weight")
        gate_up.append(torch.cat([gate, take(f"{p}{e}.{names.up}.weight")]))
        down.append(take(f"{p}{e}.{names.down}.weight"))
    return torch.stack(gate_up), torch.stack(down)


def load_moe_block(ctx: LayerContext, *, names: ExpertNames, norm_topk_prob: bool,
                   weights_in_float: bool) -> MoEBlock | None:
    """The MoE block of the layer ``ctx`` describes when it is one of the model's MoE layers
    (``dims.moe_layers``), else None (a dense MLP). A family's ``DecoderSpec.mlp`` (with its
    ``names`` and routing bound); called once per layer while the model loads."""
    dims, take, prefix = ctx.dims, ctx.take, ctx.prefix
    if ctx.index not in dims.moe_layers:
        return None
    for parent in names.parents:
        router = take(f"{prefix}{parent}.gate.weight", None)
        if router is None:
            continue
        experts = _take_experts(take, prefix, parent, names, dims.num_experts)
        if experts is None and ctx.quantized and ctx.linear is not None:
            experts = (None, None)  # per-expert projections, made by the quantization method
        if experts is None:
            raise ModelLoadError(f"{ctx.source}: {prefix}{parent}.experts: no expert weights "
                                 f"(expected {parent}.experts.gate_up_proj or per-expert tensors)")
        gate_up, down = experts
        if router.shape[0] != dims.num_experts:
            raise ModelLoadError(f"{ctx.source}: {prefix}{parent}.gate.weight has {router.shape[0]} "
                                 f"experts, the config {dims.num_experts}")
        if gate_up is None:
            gate_up, down = _quantized_experts(ctx, f"{prefix}{parent}.experts.", names)
            backend = "torch"  # one expert projection at a time (the method's own kernels)
        else:
            backend = "triton" if router.device.type == "cuda" and _has_triton() else "torch"
        return MoEBlock(router, gate_up, down, dims.num_experts_per_tok, norm_topk_prob,
                        ctx.activation, weights_in_float=weights_in_float, backend=backend)
    raise ModelLoadError(f"{ctx.source}: tensor {prefix}{names.parents[0]}.gate.weight (the router) "
                         f"is missing")


def _quantized_experts(ctx: LayerContext, p: str, names: ExpertNames) -> tuple[list, list]:
    """Each expert's gate|up and down projections of a quantized checkpoint's per-expert
    tensors (``<p><e>.<gate|up|down>``), as its method stores them (ignored modules: float)."""
    dims = ctx.dims
    inter, hidden = dims.moe_intermediate_size, dims.hidden_size
    gate_up = [ctx.linear([f"{p}{e}.{names.gate}", f"{p}{e}.{names.up}"], [(inter, hidden)] * 2)
               for e in range(dims.num_experts)]
    down = [ctx.linear([f"{p}{e}.{names.down}"], [(hidden, inter)]) for e in range(dims.num_experts)]
    return gate_up, down


def _has_triton() -> bool:
    from loramux.engine.model.triton_moe import HAS_TRITON

    return HAS_TRITON
