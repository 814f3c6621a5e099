"""Llama / Mistral / Qwen2 forward pass with fused projections and LoRA hooks.

Projections are fused per layer (q|k|v and gate|up) so a step runs four matmuls
per layer; a LoRA hook, when attached, adds each token's adapter delta to the
output of every projection group.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
import torch.nn.functional as F

from loramux.engine.model.attention import AttentionMetadata, paged_attention, write_kv
from loramux.engine.model.linear import Linear, matmul_dtype
from loramux.engine.model.small_ops import select_small_ops
from loramux.engine.model.weights import (
    ModelDims,
    ModelLoadError,
    dims_from_config,
    load_state_dict,
    read_hf_config,
)

# Projection groups a LoRA hook is called for, with the modules fused into each.
PROJECTION_GROUPS: dict[str, tuple[str, ...]] = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}


class LoRAHook(Protocol):
    """Adds adapter deltas; attached by the LoRA manager, called by every layer."""

    def active(self) -> bool:
        """True when this step has tokens with an adapter."""

    def add(self, layer: int, group: str, x: torch.Tensor, y: torch.Tensor) -> None:
        """y[T, N] += LoRA delta of group ``group`` in ``layer`` for input x[T, K]."""


@dataclass
class LayerWeights:
    input_norm: torch.Tensor
    qkv: Linear  # [q + 2 kv, H]
    o: Linear  # [H, q]
    post_norm: torch.Tensor
    gate_up: Linear  # [2 I, H]
    down: Linear  # [H, I]


class LlamaModel:
    """The base model's weights and forward pass (no autograd, no nn.Module overhead)."""

    def __init__(
        self, path: str | Path, dtype: torch.dtype, device: torch.device, *, enforce_eager: bool = False
    ) -> None:
        path = Path(path)
        self.path = path
        self.hf_config = read_hf_config(path)
        self.dims: ModelDims = dims_from_config(self.hf_config)
        self.dtype = dtype
        self.device = device
        self.lora: LoRAHook | None = None
        self._load(load_state_dict(path, dtype, device))
        self._build_rope()
        # residual add + norm, rope, activation: fused CPU kernels unless enforce_eager
        self.ops = select_small_ops(
            self.cos, self.sin, self.dims.rms_norm_eps, matmul_dtype(dtype, device), enforce_eager
        )

    # --- loading ---------------------------------------------------------------
    def _load(self, sd: dict[str, torch.Tensor]) -> None:
        d = self.dims

        def take(name: str) -> torch.Tensor:
            try:
                return sd.pop(name)
            except KeyError:
                raise ModelLoadError(f"{self.path}: tensor {name!r} is missing") from None

        self.embed = take("model.embed_tokens.weight")
        self.layers: list[LayerWeights] = []
        for i in range(d.num_layers):
            p = f"model.layers.{i}."
            q, k, v = (take(p + f"self_attn.{m}_proj.weight") for m in "qkv")
            self.layers.append(
                LayerWeights(
                    input_norm=take(p + "input_layernorm.weight"),
                    qkv=Linear(
                        torch.cat([q, k, v]),
                        self._fused_bias(
                            sd,
                            p,
                            ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                            (q, k, v),
                            required=d.qkv_bias,
                        ),
                    ),
                    o=Linear(
                        take(p + "self_attn.o_proj.weight"),
                        sd.pop(p + "self_attn.o_proj.bias", None),
                    ),
                    post_norm=take(p + "post_attention_layernorm.weight"),
                    gate_up=self._gate_up(sd, p, take),
                    down=Linear(
                        take(p + "mlp.down_proj.weight"), sd.pop(p + "mlp.down_proj.bias", None)
                    ),
                )
            )
        self.norm = take("model.norm.weight")
        if not d.tie_word_embeddings:
            self.lm_head = Linear(take("lm_head.weight"))
        else:
            sd.pop("lm_head.weight", None)
            self.lm_head = Linear(self.embed)
        leftover = [k for k in sd if not k.endswith("rotary_emb.inv_freq")]
        if leftover:
            raise ModelLoadError(f"{self.path}: unexpected tensors {leftover[:5]}")

    def _gate_up(self, sd: dict, prefix: str, take) -> Linear:
        gate, up = take(prefix + "mlp.gate_proj.weight"), take(prefix + "mlp.up_proj.weight")
        bias = self._fused_bias(
            sd, prefix, ("mlp.gate_proj", "mlp.up_proj"), (gate, up), required=False
        )
        return Linear(torch.cat([gate, up]), bias)

    def _fused_bias(
        self, sd: dict, prefix: str, names, weights, *, required: bool
    ) -> torch.Tensor | None:
        """The biases of fused projections, concatenated (zeros where one has none)."""
        biases = [sd.pop(f"{prefix}{n}.bias", None) for n in names]
        if all(b is None for b in biases):
            if required:
                raise ModelLoadError(f"{self.path}: tensor {prefix}{names[0]}.bias is missing")
            return None
        return torch.cat(
            [
                b if b is not None else w.new_zeros(w.shape[0])
                for b, w in zip(biases, weights, strict=True)
            ]
        )

    def _build_rope(self) -> None:
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        rope = LlamaRotaryEmbedding(self.hf_config)
        inv_freq = rope.inv_freq.to(torch.float32)
        self.max_positions = self.dims.max_position_embeddings
        t = torch.arange(self.max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        scaling = float(rope.attention_scaling)
        self.cos = (emb.cos() * scaling).to(self.dtype).to(self.device)  # [P, D]
        self.sin = (emb.sin() * scaling).to(self.dtype).to(self.device)

    # --- forward -----------------------------------------------------------------
    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        attn: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        logits_rows: torch.Tensor,  # [B] rows whose logits are needed
    ) -> torch.Tensor:  # [B, V] fp32
        d = self.dims
        lora = self.lora if self.lora is not None and self.lora.active() else None
        ops = self.ops
        residual = F.embedding(input_ids, self.embed)  # [T, H], updated in place by each layer
        rope = ops.rope_state(positions)
        qs, kvs = d.q_size, d.kv_size
        delta = None  # what the previous layer's MLP adds to the residual
        for i, w in enumerate(self.layers):
            x = ops.add_rms_norm(residual, delta, w.input_norm)
            qkv = w.qkv(x)  # [T, q + 2 kv]
            if lora is not None:
                lora.add(i, "qkv", x, qkv)
            # RoPE on q and k together: [T, H + Hkv, D]
            qk = ops.rope(qkv[:, : qs + kvs].view(-1, d.num_heads + d.num_kv_heads, d.head_dim), rope)
            q = qk[:, : d.num_heads]
            k = qk[:, d.num_heads :]
            v = qkv[:, qs + kvs :].reshape(-1, d.num_kv_heads, d.head_dim)
            k_cache, v_cache = kv_caches[i]
            write_kv(k_cache, v_cache, k, v, attn)
            a = paged_attention(q, k, v, k_cache, v_cache, attn)  # [T, q]
            o = w.o(a)
            if lora is not None:
                lora.add(i, "o", a, o)
            x = ops.add_rms_norm(residual, o, w.post_norm)
            gu = w.gate_up(x)  # [T, 2 I]
            if lora is not None:
                lora.add(i, "gate_up", x, gu)
            m = ops.silu_mul(gu)
            delta = w.down(m)
            if lora is not None:
                lora.add(i, "down", m, delta)
        if delta is not None:
            residual.add_(delta)
        last = residual.index_select(0, logits_rows)
        # A hidden state that overflowed (its squared norm is not finite) would normalize to
        # zeros and serve garbage as if fine: its logits row reads NaN instead, so the engine
        # fails that request alone (adapter_numerics).
        overflow = ~torch.isfinite(last.float().pow(2).sum(-1))
        logits = self.lm_head(ops.add_rms_norm(last, None, self.norm)).float()
        if bool(overflow.any()):
            logits[overflow] = float("nan")
        return logits

    def kv_bytes_per_token(self) -> int:
        d = self.dims
        return 2 * d.num_layers * d.kv_size * torch.finfo(self.dtype).bits // 8

    def weight_bytes(self) -> int:
        tensors = [self.embed, self.norm]
        linears = [self.lm_head]
        for w in self.layers:
            tensors += [w.input_norm, w.post_norm]
            linears += [w.qkv, w.o, w.gate_up, w.down]
        return sum(t.numel() * t.element_size() for t in tensors) + sum(x.nbytes for x in linears)
