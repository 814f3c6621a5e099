"""One rank's share of the weights under tensor parallelism (Megatron's layout, vLLM's rules).

Column-parallel projections (q, k, v, gate, up and the fused ``qkv_proj`` / ``gate_up_proj``
of Phi-3) keep this rank's output rows: its query heads, its KV heads and its slice of the
intermediate size. Row-parallel ones (o, down) keep the matching input columns; their outputs
are partial sums that one all-reduce per layer and block adds up (their bias stays on rank 0
only, so it is added once). With fewer KV heads than ranks every KV head is replicated on
``world / num_kv_heads`` ranks, each rank holding the one its query heads read (vLLM's rule).
Everything else (embedding, norms, ``lm_head``) is replicated.

A LoRA follows its projection: on a column-parallel layer A stays whole and B keeps the rank's
rows; on a row-parallel one A keeps the rank's input columns and B stays whole, so the delta
is a partial sum too and joins the base output before the all-reduce.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from loramux.adapters.weights import LoraWeights
from loramux.engine.errors import LoRAError, ModelLoadError
from loramux.engine.model.weights import ModelDims

COLUMN_PARALLEL = frozenset({"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "qkv_proj",
                             "gate_up_proj"})
"""Projections whose output rows are split over the ranks."""
ROW_PARALLEL = frozenset({"o_proj", "down_proj"})
"""Projections whose input columns are split over the ranks (their outputs are summed)."""
EXPERT_COLUMN = frozenset({"gate_proj", "up_proj", "w1", "w3"})
EXPERT_ROW = frozenset({"down_proj", "w2"})
"""One expert's projections as checkpoints name them (``<parent>.experts.<e>.<name>.weight``;
Mixtral's ``w1`` / ``w3`` / ``w2``): every rank holds every expert, with its share of the
expert's intermediate size (sharded experts, as vLLM's default: the block's output is a
partial sum like a dense MLP's, and the router stays whole, so no token moves between ranks)."""

Ranges = list[tuple[int, int]]
QUANTIZED_AXES = {
    # compressed-tensors, [out, in]: pack-quantized words along the input, zero points packed
    # along the output, scales per row and group (FP8's per row or per tensor)
    "weight_packed": (0, 1), "weight_scale": (0, 1), "weight_zero_point": (0, 1),
    # AWQ ([in, out / 8] words along the output) and GPTQ ([in / per, out] words along the input)
    "qweight": (1, 0), "qzeros": (1, 0), "scales": (1, 0),
}
"""A quantized projection's tensors: (the axis of its output rows, the axis of its input
columns), each counting packed words or groups (a size 1: every row or column shares it)."""
GROUPED_ROWS = ("scales", "qzeros")
"""AWQ's and GPTQ's per-group tensors ([groups, out]-major): a row-parallel share's groups
depend on GPTQ's ``g_idx`` (:meth:`TensorShard.settle`)."""
QUANTIZED = frozenset({*QUANTIZED_AXES, "weight_shape", "g_idx"})
"""The stored tensors of a quantized projection (FP8's ``weight`` is a plain one)."""


def check_shardable(dims: ModelDims, world: int) -> None:
    """Raise :class:`ModelLoadError` naming why ``dims`` cannot be split over ``world`` ranks."""
    name = f"tensor_parallel_size {world} cannot split {dims.model_type}"
    why = []
    if dims.num_experts and dims.moe_intermediate_size % world:
        why.append(f"its experts' intermediate size {dims.moe_intermediate_size}")
    if dims.num_heads % world:
        why.append(f"its {dims.num_heads} attention heads")
    if dims.num_kv_heads % world and world % dims.num_kv_heads:
        why.append(f"its {dims.num_kv_heads} KV heads (nor {world} by them)")
    if dims.intermediate_size % world:
        why.append(f"its intermediate size {dims.intermediate_size}")
    if dims.vocab_size < world:
        why.append(f"its vocabulary of {dims.vocab_size}")
    if why:
        raise ModelLoadError(f"{name}: " + ", ".join(why) + f" are not divisible by {world}")


@dataclass(frozen=True)
class TensorShard:
    """Rank ``rank`` of ``world``: which rows and columns of each projection it holds."""

    rank: int
    world: int
    dims: ModelDims
    """The whole model's dimensions."""

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world:
            raise ValueError(f"rank {self.rank} is outside a world of {self.world}")
        check_shardable(self.dims, self.world)

    @property
    def num_heads(self) -> int:
        return self.dims.num_heads // self.world

    @property
    def num_kv_heads(self) -> int:
        return max(1, self.dims.num_kv_heads // self.world)

    @property
    def intermediate(self) -> int:
        return self.dims.intermediate_size // self.world

    @property
    def local_dims(self) -> ModelDims:
        """The dimensions this rank computes with (heads, KV heads, intermediate size)."""
        return dataclasses.replace(self.dims, num_heads=self.num_heads,
                                   num_kv_heads=self.num_kv_heads,
                                   intermediate_size=self.intermediate,
                                   moe_intermediate_size=self.dims.moe_intermediate_size // self.world)

    # --- which rows --------------------------------------------------------------------
    def _q(self) -> tuple[int, int]:
        n = self.num_heads * self.dims.head_dim
        return self.rank * n, (self.rank + 1) * n

    def _kv(self) -> tuple[int, int]:
        d, kv = self.dims.head_dim, self.dims.num_kv_heads
        first = (self.rank * kv // self.world if kv >= self.world
                 else self.rank // (self.world // kv))
        return first * d, (first + self.num_kv_heads) * d

    def vocab_range(self, rank: int | None = None) -> tuple[int, int]:
        """The vocabulary rows (token ids) of the embedding and ``lm_head`` that ``rank``
        (default: this one) holds: ``ceil(vocab / world)`` each, the last rank the rest."""
        rank = self.rank if rank is None else rank
        vocab = self.dims.vocab_size
        per = -(-vocab // self.world)
        return min(rank * per, vocab), min((rank + 1) * per, vocab)

    def _mlp(self) -> tuple[int, int]:
        return self.rank * self.intermediate, (self.rank + 1) * self.intermediate

    def out_ranges(self, module: str) -> Ranges:
        """The rows of a column-parallel ``module``'s output this rank keeps, in order."""
        q, kv, inter = self.dims.q_size, self.dims.kv_size, self.dims.intermediate_size
        k0, k1 = self._kv()
        m0, m1 = self._mlp()
        return {
            "q_proj": [self._q()], "k_proj": [(k0, k1)], "v_proj": [(k0, k1)],
            "qkv_proj": [self._q(), (q + k0, q + k1), (q + kv + k0, q + kv + k1)],
            "gate_proj": [(m0, m1)], "up_proj": [(m0, m1)],
            "gate_up_proj": [(m0, m1), (inter + m0, inter + m1)],
        }[module]

    def in_range(self, module: str) -> tuple[int, int]:
        """The input columns of a row-parallel ``module`` this rank keeps."""
        return self._q() if module == "o_proj" else self._mlp()

    # --- base weights --------------------------------------------------------------------
    def take(self, name: str, tensor) -> torch.Tensor | None:
        """This rank's part of the checkpoint tensor ``name`` (canonical), read from ``tensor``
        (a safetensors slice, so only these rows are read, or a tensor); None: not on this
        rank (a row-parallel bias off rank 0)."""
        parts = name.split(".")
        module, kind = (parts[-2], parts[-1]) if len(parts) >= 2 else ("", "")
        if "experts" in parts:
            return self._expert(parts, tensor)
        if name in ("model.embed_tokens.weight", "lm_head.weight"):  # vocabulary-parallel
            a, b = self.vocab_range()
            return tensor[a:b]
        if (module in COLUMN_PARALLEL or module in ROW_PARALLEL) and kind in QUANTIZED:
            k_in, n_out = self.dims.module_shapes()[module]
            column = module in COLUMN_PARALLEL
            ranges = self.out_ranges(module) if column else [self.in_range(module)]
            return self._quantized(module, kind, tensor, column, ranges, k_in, n_out)
        if module in COLUMN_PARALLEL and kind in ("weight", "bias"):
            return self.rows_of(module, tensor)
        if module in ROW_PARALLEL and kind == "bias":
            return tensor[:] if self.rank == 0 else None
        if module in ROW_PARALLEL and kind == "weight":
            a, b = self.in_range(module)
            return tensor[:, a:b]
        return tensor[:]

    def _quantized(self, module: str, kind: str, tensor, column: bool, ranges: Ranges,
                   k_in: int, n_out: int) -> torch.Tensor:
        """A quantized tensor's share (:data:`QUANTIZED_AXES`) of a projection ``[n_out, k_in]``
        split along its output rows (``column``) or input columns in ``ranges``: the units
        (packed words, groups) of those rows or columns, a per-tensor or per-row scale whole
        where every share uses it; compressed-tensors' stored ``weight_shape`` made the
        share's; a row-parallel share's AWQ / GPTQ groups and ``g_idx`` are read whole and
        cut by :meth:`settle`."""
        shape = list(tensor.get_shape()) if hasattr(tensor, "get_shape") else list(tensor.shape)
        if kind == "weight_shape":
            rows = sum(e - s for s, e in ranges) if column else n_out
            cols = k_in if column else ranges[0][1] - ranges[0][0]
            return torch.tensor([rows, cols], dtype=tensor[:].dtype)
        if kind == "g_idx":
            return tensor[:] if column else tensor[ranges[0][0] : ranges[0][1]]
        axis = QUANTIZED_AXES[kind][0 if column else 1]
        if len(shape) < 2 or shape[axis] == 1 or (not column and kind in GROUPED_ROWS):
            return tensor[:]  # row-parallel groups: cut by settle(), which sees g_idx
        size = n_out if column else k_in
        if size % shape[axis]:
            raise ModelLoadError(f"{module}.{kind} is {shape}: {shape[axis]} does not divide {size}")
        per = size // shape[axis]  # values a stored unit holds: a packed word, a group
        parts = [tensor[s // per : e // per] if axis == 0 else tensor[:, s // per : e // per]
                 for s, e in self._aligned(ranges, per, module)]
        return torch.cat(parts, dim=axis) if len(parts) > 1 else parts[0]

    def settle(self, sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """After loading, what needs several tensors of one module: a row-parallel AWQ / GPTQ
        projection's ``scales`` and ``qzeros`` (read whole) cut to the groups of its share
        and its ``g_idx`` rebased to the first of them; under GPTQ's activation order (a
        ``g_idx`` that is not consecutive) the share's columns draw on every group, so they
        stay whole and ``g_idx`` keeps the global groups (the method regroups the share's
        columns, ``repacked.regroup``). Returns ``sd``, settled in place."""
        for name in [n for n in sd if n.endswith(".scales")]:
            prefix = name.removesuffix("scales")
            module = prefix.split(".")[-2]
            if self._expert_row(prefix):
                k_in, (a, b) = self.dims.moe_intermediate_size, self._expert_range()
            elif module in ROW_PARALLEL:
                k_in, (a, b) = self.dims.module_shapes()[module][0], self.in_range(module)
            else:
                continue
            groups = sd[name].shape[0]
            if groups == 1:
                continue
            per = k_in // groups
            g_idx = sd.get(prefix + "g_idx")
            if g_idx is not None and not bool((g_idx.long() == torch.arange(a, b) // per).all()):
                continue  # activation order: every group stays, g_idx global
            self._aligned([(a, b)], per, prefix.rstrip("."))
            for kind in GROUPED_ROWS:
                if prefix + kind in sd:
                    sd[prefix + kind] = sd[prefix + kind][a // per : b // per]
            if g_idx is not None:
                sd[prefix + "g_idx"] = g_idx - a // per
        return sd

    def _expert_row(self, prefix: str) -> bool:
        parts = prefix.rstrip(".").split(".")
        return "experts" in parts and parts[-1] in EXPERT_ROW

    def _aligned(self, ranges: Ranges, per: int, module: str) -> Ranges:
        """``ranges`` when each starts and ends on a stored unit of ``per`` values (a packed
        word, a group), else a :class:`ModelLoadError` naming the module."""
        if any(s % per or e % per for s, e in ranges):
            raise ModelLoadError(f"tensor_parallel_size {self.world}: {module}'s share does not fall on "
                                 f"its quantized layout's units of {per} values (groups or packed words)")
        return ranges

    def _expert_range(self) -> tuple[int, int]:
        n = self.dims.moe_intermediate_size // self.world
        return self.rank * n, (self.rank + 1) * n

    def _expert(self, parts: list[str], tensor) -> torch.Tensor:
        """An expert tensor's share: per expert ``[I, H]`` rows / ``[H, I]`` columns (stored
        plain or quantized: that projection's packed words, groups and scales), or the fused
        ``gate_up_proj`` [E, 2I, H] and ``down_proj`` [E, H, I] of transformers 5."""
        a, b = self._expert_range()
        inter = self.dims.moe_intermediate_size
        if parts[-2] == "experts" and parts[-1] == "gate_up_proj":
            return torch.cat([tensor[:, a:b], tensor[:, inter + a : inter + b]], dim=1)
        if parts[-2] == "experts" and parts[-1] == "down_proj":
            return tensor[:, :, a:b]
        if parts[-2] in (EXPERT_COLUMN | EXPERT_ROW) and parts[-1] in QUANTIZED:
            column = parts[-2] in EXPERT_COLUMN
            hidden = self.dims.hidden_size
            k_in, n_out = (hidden, inter) if column else (inter, hidden)
            return self._quantized(".".join(parts[:-1]), parts[-1], tensor, column, [(a, b)], k_in, n_out)
        if parts[-2] in EXPERT_COLUMN and parts[-1] == "weight":
            return tensor[a:b]
        if parts[-2] in EXPERT_ROW and parts[-1] == "weight":
            return tensor[:, a:b]
        return tensor[:]

    # --- adapters --------------------------------------------------------------------------
    def lora(self, weights: LoraWeights, rank_share: int | None = None) -> LoraWeights:
        """This rank's part of an adapter: B's rows of column-parallel projections, A's columns
        of row-parallel ones (the rest, vocabulary and norm parts included, is replicated).
        ``rank_share`` (``fully_sharded_loras``, ``lora/sharded.py``): also A's rank rows
        ``[rank·share, (rank+1)·share)`` of column-parallel projections and B's ``1/world`` of
        the output rows of row-parallel ones."""
        layers = {}
        for i, modules in weights.layers.items():
            out = {}
            for name, (a, b) in modules.items():
                if name in COLUMN_PARALLEL:
                    b = self.rows_of(name, b)
                    if rank_share is not None:
                        a = a[self.rank * rank_share : (self.rank + 1) * rank_share]
                elif name in ROW_PARALLEL:
                    s, e = self.in_range(name)
                    a = a[:, s:e]
                    if rank_share is not None:
                        n = b.shape[0] // self.world
                        b = b[self.rank * n : (self.rank + 1) * n]
                out[name] = (a.contiguous(), b.contiguous())
            layers[i] = out
        a0, a1 = self._expert_range()
        inter = self.dims.moe_intermediate_size
        experts = {}
        for i, params in weights.experts.items():
            out = dict(params)  # the router's LoRA stays whole
            if "gate_up_proj" in params:  # A [E, r, H], B [E, 2I, r]: B's rows
                a, b = params["gate_up_proj"]
                out["gate_up_proj"] = (a, torch.cat([b[:, a0:a1], b[:, inter + a0 : inter + a1]], 1))
            if "down_proj" in params:  # A [E, r, I], B [E, H, r]: A's columns
                a, b = params["down_proj"]
                out["down_proj"] = (a[:, :, a0:a1].contiguous(), b)
            experts[i] = out
        return dataclasses.replace(weights, layers=layers, experts=experts,
                                   dora_scales=self._dora_share(weights.dora_scales))

    def _dora_share(self, scales: dict) -> dict:
        """A DoRA adapter's per-row ``(g, c)`` on this rank: a column-parallel projection's
        rows; a row-parallel one's whole, its bias correction on rank 0 only (where the bias
        is added)."""
        out = {}
        for layer, modules in scales.items():
            share = {}
            for name, (g, c) in modules.items():
                if name in COLUMN_PARALLEL:
                    g = self.rows_of(name, g)
                    c = None if c is None else self.rows_of(name, c)
                elif name in ROW_PARALLEL and self.rank != 0:
                    c = None
                share[name] = (g, c)
            out[layer] = share
        return out

    def rows_of(self, module: str, t: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a column-parallel ``module``'s output vector ``t``."""
        return torch.cat([t[s:e] for s, e in self.out_ranges(module)])

    def join_dora(self, per_rank: list) -> dict:
        """The whole model's DoRA parts (``dora.RankParts``) from every rank's, rank 0 first: a
        column-parallel projection's rows put back in place (a replicated KV head's from any
        of its ranks), a row-parallel one's partial sums added up (its bias is rank 0's).
        Raises :class:`LoRAError` when a rank failed (its entry is the error's text)."""
        for rank, parts in enumerate(per_rank):
            if isinstance(parts, str):
                raise LoRAError(f"tensor-parallel rank {rank} could not scale the DoRA adapter: {parts}")
        ranks = [dataclasses.replace(self, rank=r) for r in range(self.world)]
        joined = {}
        for key, (norm_sq, bias) in per_rank[0].items():
            module = key[1]
            if module in COLUMN_PARALLEL:
                norm_sq = self._place(module, ranks, [p[key][0] for p in per_rank])
                if bias is not None:
                    bias = self._place(module, ranks, [p[key][1] for p in per_rank])
            elif module in ROW_PARALLEL:
                norm_sq = sum((p[key][0] for p in per_rank[1:]), norm_sq)
            joined[key] = (norm_sq, bias)
        return joined

    def _place(self, module: str, ranks: list[TensorShard], parts: list[torch.Tensor]) -> torch.Tensor:
        """A column-parallel ``module``'s whole output vector from each rank's rows."""
        whole = parts[0].new_zeros(self.dims.module_shapes()[module][1])
        for shard, part in zip(ranks, parts, strict=True):
            at = 0
            for s, e in shard.out_ranges(module):
                whole[s:e] = part[at : at + e - s]
                at += e - s
        return whole
