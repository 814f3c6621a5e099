"""The decoder forward pass every family runs, with fused projections and LoRA hooks.

A family is data (:class:`~loramux.engine.model.spec.DecoderSpec`, built by
``models/<family>.py``): norm offset, the norms' checkpoint names (sandwich norms), q/k norms,
activation, embedding scale, softmax scale, soft-caps, per-layer windows and rotary tables,
fused checkpoint names, and where it must be code its own feed-forward block (``spec.mlp``,
handed a :class:`~loramux.engine.model.spec.LayerContext` per layer). Projections are fused
per layer (q|k|v and gate|up) so a step runs four matmuls per layer; a LoRA hook, when
attached, adds each token's adapter delta to the output of every projection group
(:data:`~loramux.adapters.arch.PROJECTION_GROUPS`). Attention reads the paged KV cache
through the step's metadata of the layer's window.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
import torch.nn.functional as F

from loramux.adapters.arch import PROJECTION_GROUPS, resolve_architecture
from loramux.engine.distributed.vocab import rank_parts
from loramux.engine.model.attention import AttentionMetadata, paged_attention, write_kv
from loramux.engine.model.hooks import LoRAHook
from loramux.engine.model.layers import Norms, gated_activation
from loramux.engine.model.linear import Linear, matmul_dtype
from loramux.engine.model.quant.base import QuantLinear
from loramux.engine.model.quant.select import quant_method
from loramux.engine.model.rotary import RotaryTable, rotary_table
from loramux.engine.model.small_ops import EagerOps, select_small_ops
from loramux.engine.model.spec import DecoderSpec, LayerContext, LayerSpec
from loramux.engine.model.weights import (
    ModelDims,
    ModelLoadError,
    dims_from_config,
    load_state_dict,
    read_hf_config,
    text_config,
)

__all__ = ["PROJECTION_GROUPS", "DecoderModel", "GatedMLP", "LayerMLP", "LoRAHook"]


class LayerMLP(Protocol):
    """A layer's feed-forward block: the dense :class:`GatedMLP`, or what a family's
    ``DecoderSpec.mlp`` builds (MoE experts and their router)."""

    linears: list[Linear | QuantLinear]
    """Its weights (``weight_bytes``)."""

    def __call__(self, x: torch.Tensor, layer: int, lora: LoRAHook | None) -> torch.Tensor:
        """The block's output [T, H] for its normalized input x [T, H] (adding LoRA deltas
        through ``lora`` where the block has projection groups)."""


class GatedMLP:
    """``down(act(gate) * up)`` with gate|up fused into one projection."""

    def __init__(self, gate_up: Linear | QuantLinear, down: Linear | QuantLinear, act) -> None:
        self.gate_up = gate_up  # [2 I, H]
        self.down = down  # [H, I]
        self.act = act

    def __call__(self, x: torch.Tensor, layer: int, lora: LoRAHook | None) -> torch.Tensor:
        gu = self.gate_up(x)  # [T, 2 I]
        if lora is not None:
            lora.add(layer, "gate_up", x, gu)
        m = self.act(gu)  # [T, I]
        y = self.down(m)  # [T, H]
        if lora is not None:
            lora.add(layer, "down", m, y)
        return y

    @property
    def linears(self) -> list[Linear | QuantLinear]:
        return [self.gate_up, self.down]


@dataclass
class LayerWeights:
    attn_norm: torch.Tensor
    qkv: Linear | QuantLinear  # [q + 2 kv, H]
    o: Linear | QuantLinear  # [H, q]
    ffn_norm: torch.Tensor
    mlp: LayerMLP
    ops: EagerOps  # the small ops bound to this layer's rotary table
    rope: str | None  # this layer's rotary table
    window: int | None  # this layer's sliding window
    q_norm: torch.Tensor | None = None  # [D]
    k_norm: torch.Tensor | None = None
    attn_out_norm: torch.Tensor | None = None  # sandwich norms [H]
    ffn_out_norm: torch.Tensor | None = None


class DecoderModel:
    """The base model's weights and forward pass (no autograd, no nn.Module overhead).
    Built by :func:`~loramux.engine.model.registry.load_model` from a family's spec."""

    def __init__(
        self,
        path: str | Path,
        dtype: torch.dtype,
        device: torch.device,
        *,
        spec: DecoderSpec,
        enforce_eager: bool = False,
        hf_config=None,
        quantization: str | None = None,
        tensor_parallel: tuple[int, int] | None = None,
    ) -> None:
        """``quantization``: ``--quantization`` (None: whatever the checkpoint's
        ``quantization_config`` says; see ``quant/select.py``); ``tensor_parallel``: (rank,
        world) to hold only that rank's share (``engine/distributed/shard.py``)."""
        path = Path(path)
        self.path = path
        self.hf_config = hf_config if hf_config is not None else read_hf_config(path)
        self.arch = resolve_architecture(self.hf_config)
        self.text_config = text_config(self.hf_config)
        self.dims: ModelDims = dims_from_config(self.hf_config)
        if len(spec.layers) != self.dims.num_layers:
            raise ModelLoadError(f"{path}: {len(spec.layers)} layer specs for {self.dims.num_layers} layers")
        self.spec = spec
        # this rank's share, the dimensions it computes with, its all-reduce, its vocabulary
        self.shard, self.local_dims, self._reduce, self.vocab = rank_parts(tensor_parallel, self.dims)
        self.family = self.dims.family
        self.dtype = dtype
        self.device = device
        self.max_positions = self.dims.max_position_embeddings
        self.rotary: dict[str | None, RotaryTable] = {
            kind: rotary_table(self.text_config, kind, self.max_positions, dtype, device)
            for kind in spec.rope_layer_types
        }
        # residual add + norm, rope, activation: fused CPU kernels unless enforce_eager
        act_dtype = matmul_dtype(dtype, device)
        self.ops_by_rope = {
            kind: select_small_ops(t.cos, t.sin, self.dims.rms_norm_eps, act_dtype, enforce_eager)
            for kind, t in self.rotary.items()
        }
        self.ops = next(iter(self.ops_by_rope.values()))
        self.norms = Norms(self.ops, self.dims.rms_norm_eps, spec.norm_offset)
        self.quant = quant_method(self.hf_config, quantization, str(path))
        """How the checkpoint stores the projections (``quant/``)."""
        shard = self.shard
        self.quant.tensor_parallel_size = shard.world if shard is not None else 1
        sd = load_state_dict(path, dtype, device, self.arch, self.quant.keeps_stored_dtype,
                             take=shard.take if shard is not None else None)
        self._load(shard.settle(sd) if shard is not None else sd)
        self.attention_windows = spec.windows
        """The distinct sliding windows of the layers (the runner builds metadata per window)."""
        self.embed_scale = (
            torch.tensor(spec.embed_scale, dtype=torch.float32).to(dtype).item()
            if spec.embed_scale is not None else None
        )
        self.attn_scale = spec.attn_scale
        self.attn_softcap = spec.attn_softcap

    # --- loading ---------------------------------------------------------------------
    def _load(self, sd: dict[str, torch.Tensor]) -> None:
        d, s = self.dims, self.spec

        def take(name: str, *default):
            """Pop a tensor (or return ``default`` when given and the tensor is absent)."""
            try:
                return sd.pop(name, *default)
            except KeyError:
                raise ModelLoadError(f"{self.path}: tensor {name!r} is missing") from None

        self.embed = take("model.embed_tokens.weight")
        self.layers: list[LayerWeights] = [
            self._load_layer(i, ls, sd, take) for i, ls in enumerate(s.layers)
        ]
        self.norm = take("model.norm.weight")
        if not d.tie_word_embeddings:
            self.lm_head = self._linear(["lm_head"], take, None)
        else:
            sd.pop("lm_head.weight", None)
            self.lm_head = Linear(self.embed)
        leftover = [k for k in sd if not k.endswith("rotary_emb.inv_freq")]
        if leftover:
            raise ModelLoadError(f"{self.path}: unexpected tensors {leftover[:5]}")

    def _load_layer(self, i: int, ls: LayerSpec, sd: dict, take) -> LayerWeights:
        s, p = self.spec, f"model.layers.{i}."
        ops = self.ops_by_rope[ls.rope]
        act = gated_activation(s.activation, ops)
        mlp = None
        if s.mlp is not None:
            mlp = s.mlp(LayerContext(
                index=i, prefix=p, dims=self.local_dims, activation=act, take=take, source=str(self.path),
                quantized=self.quant.quantized,
                linear=lambda modules, shapes: self.quant.create_linear(
                    modules, take, None, shapes=shapes, dtype=self.dtype)))
        if mlp is None:
            down = self._linear([p + "mlp.down_proj"], take, sd.pop(p + "mlp.down_proj.bias", None))
            mlp = GatedMLP(self._gate_up(sd, p, take), down, act)
        names = s.norms
        return LayerWeights(
            attn_norm=take(p + names.attn + ".weight"),
            qkv=self._qkv(sd, p, take),
            o=self._linear([p + "self_attn.o_proj"], take, sd.pop(p + "self_attn.o_proj.bias", None)),
            ffn_norm=take(p + names.ffn + ".weight"),
            mlp=mlp,
            ops=ops,
            rope=ls.rope,
            window=ls.window,
            q_norm=take(p + "self_attn.q_norm.weight") if s.qk_norm else None,
            k_norm=take(p + "self_attn.k_norm.weight") if s.qk_norm else None,
            attn_out_norm=take(p + names.attn_out + ".weight") if names.attn_out else None,
            ffn_out_norm=take(p + names.ffn_out + ".weight") if names.ffn_out else None,
        )

    def _linear(self, modules: list[str], take, bias: torch.Tensor | None) -> Linear | QuantLinear:
        """One projection of ``modules`` (canonical names without ``.weight``; several: fused
        along the output rows), stored as the checkpoint's quantization method says."""
        shapes = [self._config_shape(m) for m in modules]
        return self.quant.create_linear(modules, take, bias, shapes=shapes, dtype=self.dtype)

    def _config_shape(self, module: str) -> tuple[int, int] | None:
        """``(out, in)`` of a projection as the config says (None: a name it does not know)."""
        name = module.rsplit(".", 1)[-1]
        if name == "lm_head":
            vocab = self.dims.vocab_size if self.vocab is None else self.vocab.end - self.vocab.start
            return vocab, self.dims.hidden_size
        shapes = self.local_dims.module_shapes()
        return (shapes[name][1], shapes[name][0]) if name in shapes else None

    def _qkv(self, sd: dict, prefix: str, take) -> Linear | QuantLinear:
        fused = self.spec.fused_qkv
        if fused is not None:
            p = f"{prefix}self_attn.{fused}"
            return self._linear([p], take, sd.pop(p + ".bias", None))
        names = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"]
        bias = self._fused_bias(sd, prefix, names, required=self.spec.qkv_bias)
        return self._linear([prefix + n for n in names], take, bias)

    def _gate_up(self, sd: dict, prefix: str, take) -> Linear | QuantLinear:
        fused = self.spec.fused_gate_up
        if fused is not None:
            p = f"{prefix}mlp.{fused}"
            return self._linear([p], take, sd.pop(p + ".bias", None))
        names = ["mlp.gate_proj", "mlp.up_proj"]
        bias = self._fused_bias(sd, prefix, names, required=False)
        return self._linear([prefix + n for n in names], take, bias)

    def _fused_bias(self, sd: dict, prefix: str, names, *, required: bool) -> torch.Tensor | None:
        """The biases of fused projections, concatenated (zeros where one has none)."""
        biases = [sd.pop(f"{prefix}{n}.bias", None) for n in names]
        if all(b is None for b in biases):
            if required:
                raise ModelLoadError(f"{self.path}: tensor {prefix}{names[0]}.bias is missing")
            return None
        return torch.cat([
            b if b is not None else torch.zeros(self._config_shape(n)[0], dtype=self.dtype,
                                                device=self.device)
            for b, n in zip(biases, names, strict=True)
        ])

    # --- forward -----------------------------------------------------------------------
    def prefix_cache_salt(self, num_prompt_tokens: int) -> str | None:
        """What sets a sequence's keys apart from others' at the same positions (LongRoPE
        with a long prompt), for its prefix-cache identity; None for most models. Called
        when a request is added."""
        salts = {t.prefix_cache_salt(num_prompt_tokens) for t in self.rotary.values()} - {None}
        return "|".join(sorted(salts)) or None

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        attn: dict[int | None, AttentionMetadata] | AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        logits_rows: torch.Tensor,  # [B] rows whose logits are needed
        prompt_lens: torch.Tensor | None = None,  # [T] prompt length of each token's sequence
        lora: LoRAHook | None = None,
    ) -> torch.Tensor:  # [B, V] fp32
        """One step over the batch's new tokens; ``attn`` holds the step's attention metadata
        per sliding window (:attr:`attention_windows`); ``lora``: the step's adapters (the
        runner's hook, laid out for this step; None or inactive: base model only)."""
        d, s, reduce = self.local_dims, self.spec, self._reduce
        lora = lora if lora is not None and lora.active() else None
        norms = self.norms
        if isinstance(attn, AttentionMetadata):
            attn = dict.fromkeys(self.attention_windows, attn)
        residual = (F.embedding(input_ids, self.embed) if self.vocab is None  # [T, H], updated
                    else self.vocab.embed(input_ids, self.embed))  # in place by each layer
        if lora is not None:
            lora.embed(input_ids, residual)
        if self.embed_scale is not None:
            residual.mul_(self.embed_scale)
        rope = {
            kind: self.ops_by_rope[kind].rope_state(t.index(positions, prompt_lens))
            for kind, t in self.rotary.items()
        }
        heads, kv_heads, head_dim = d.num_heads, d.num_kv_heads, d.head_dim
        qs, kvs = d.q_size, d.kv_size
        delta = None  # what the previous layer's MLP adds to the residual
        names = s.norms
        add_norm = self._add_norm
        for i, w in enumerate(self.layers):
            x = norms.add_norm(residual, delta, w.attn_norm)
            if lora is not None:
                lora.norm((i, names.attn), add_norm, residual, x)
            qkv = w.qkv(x)  # [T, q + 2 kv]
            if lora is not None:
                lora.add(i, "qkv", x, qkv)
            qk = qkv[:, : qs + kvs].view(-1, heads + kv_heads, head_dim)  # [T, H + Hkv, D]
            if w.q_norm is not None:
                raw, qk = qk, torch.cat([norms.norm(qk[:, :heads], w.q_norm), norms.norm(qk[:, heads:], w.k_norm)], 1)
                if lora is not None:
                    lora.norm((i, "self_attn.q_norm"), norms.norm, raw[:, :heads], qk[:, :heads])
                    lora.norm((i, "self_attn.k_norm"), norms.norm, raw[:, heads:], qk[:, heads:])
            qk = self._rope(qk, w, rope[w.rope])
            q, k = qk[:, :heads], qk[:, heads:]
            v = qkv[:, qs + kvs :].reshape(-1, kv_heads, head_dim)
            k_cache, v_cache = kv_caches[i]
            meta = attn[w.window]
            write_kv(k_cache, v_cache, k, v, meta)
            a = paged_attention(q, k, v, k_cache, v_cache, meta, scale=self.attn_scale,
                                softcap=self.attn_softcap)  # [T, q]
            o = w.o(a)
            if lora is not None:
                lora.add(i, "o", a, o)
            if reduce is not None:  # row-parallel: the ranks' partial sums (LoRA's included)
                reduce(o)
            if w.attn_out_norm is not None:
                o, raw = norms.sandwich(o, w.attn_out_norm), o
                if lora is not None:
                    lora.norm((i, names.attn_out), norms.sandwich, raw, o)
            x = norms.add_norm(residual, o, w.ffn_norm)
            if lora is not None:
                lora.norm((i, names.ffn), add_norm, residual, x)
            delta = w.mlp(x, i, lora)
            if reduce is not None:
                reduce(delta)
            if w.ffn_out_norm is not None:
                delta, raw = norms.sandwich(delta, w.ffn_out_norm), delta
                if lora is not None:
                    lora.norm((i, names.ffn_out), norms.sandwich, raw, delta)
        if delta is not None:
            residual.add_(delta)
        last = residual.index_select(0, logits_rows)
        # A hidden state that overflowed (its squared norm is not finite) would normalize to
        # zeros and serve garbage as if fine: its logits row reads NaN instead (that request fails).
        overflow = ~torch.isfinite(last.float().pow(2).sum(-1))
        hidden = norms.add_norm(last, None, self.norm)
        if lora is not None:
            lora.norm((None, "norm"), add_norm, last, hidden, logits_rows)
        logits = self.lm_head(hidden).float() if self.vocab is None else self.vocab.logits(hidden, self.lm_head)
        if logits is None:  # a worker: rank 0 has the whole logits and samples
            return hidden.new_empty(len(logits_rows), 0)
        if lora is not None:
            lora.head(hidden, logits, logits_rows)
        cap = s.final_softcap
        if cap:
            logits = torch.tanh(logits / cap) * cap
        if bool(overflow.any()):
            logits[overflow] = float("nan")
        return logits

    def _rope(self, qk: torch.Tensor, w: LayerWeights, state) -> torch.Tensor:
        """Rotary embedding of q|k [T, H + Hkv, D] (of the first ``rotary_dim`` dims of each head)."""
        rot = self.rotary[w.rope].rotary_dim
        if rot == qk.shape[-1]:
            return w.ops.rope(qk, state)
        part = qk[..., :rot]
        rotated = w.ops.rope(part, state)
        if rotated is not part:
            part.copy_(rotated)
        return qk

    def kv_bytes_per_token(self) -> int:
        d = self.local_dims
        return 2 * d.num_layers * d.kv_size * torch.finfo(self.dtype).bits // 8

    def _add_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """The residual norm of rows ``x`` (already summed) with ``weight``: an adapter's own."""
        return self.norms.add_norm(x, None, weight)

    def norm_weights(self) -> dict[tuple[int | None, str], torch.Tensor]:
        """The norms by ``(layer, checkpoint name)`` (layer None: the final ``norm``): what an
        adapter's ``modules_to_save`` copies may replace (``engine/lora/norms.py``)."""
        n = self.spec.norms
        out: dict[tuple[int | None, str], torch.Tensor] = {(None, "norm"): self.norm}
        for i, w in enumerate(self.layers):
            named = {n.attn: w.attn_norm, n.ffn: w.ffn_norm, n.attn_out: w.attn_out_norm,
                     n.ffn_out: w.ffn_out_norm, "self_attn.q_norm": w.q_norm, "self_attn.k_norm": w.k_norm}
            out.update({(i, name): t for name, t in named.items() if name and t is not None})
        return out

    def weight_bytes(self) -> int:
        tensors = [self.embed, self.norm]
        linears = [self.lm_head]
        for w in self.layers:
            tensors += [t for t in (w.attn_norm, w.ffn_norm, w.q_norm, w.k_norm, w.attn_out_norm,
                                    w.ffn_out_norm) if t is not None]
            linears += [w.qkv, w.o, *w.mlp.linears]
        return sum(t.numel() * t.element_size() for t in tensors) + sum(x.nbytes for x in linears)

