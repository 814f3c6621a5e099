"""What a family's decoder is, as data: the shared forward pass (``decoder.py``) reads a
:class:`DecoderSpec` that each family module (``models/<family>.py``) builds from the Hugging
Face config. Everything that differs between the dense families is a field here; a family
whose layers need other code (MoE experts) supplies its own feed-forward builder (``mlp``),
which gets a :class:`LayerContext` per layer."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from loramux.engine.model.weights import ModelDims


@dataclass(frozen=True)
class LayerSpec:
    """One decoder layer's attention: its sliding window and its rotary table."""

    window: int | None = None
    """Keys within the last ``window`` positions (None: the whole context)."""
    rope: str | None = None
    """Key of the layer's table in :attr:`DecoderSpec.rope_layer_types` (None: the model's one)."""


@dataclass(frozen=True)
class NormNames:
    """A layer's RMSNorms as the family's checkpoints name them
    (``model.layers.<i>.<name>.weight``); the defaults are Llama's two."""

    attn: str = "input_layernorm"
    """Before attention."""
    ffn: str = "post_attention_layernorm"
    """Before the feed-forward block."""
    attn_out: str | None = None
    """On attention's output before it joins the residual (None: no such norm)."""
    ffn_out: str | None = None
    """On the feed-forward block's output before it joins the residual (None: none)."""


@dataclass(frozen=True)
class LayerContext:
    """What a family's feed-forward builder (:attr:`DecoderSpec.mlp`) is handed for one layer,
    once, while the model loads."""

    index: int
    """The layer's index."""
    prefix: str
    """Its tensors' prefix in the canonical checkpoint names (``model.layers.<index>.``)."""
    dims: ModelDims
    """The dimensions this rank computes with (experts, MoE layers; sizes are its share under
    tensor parallelism, ``TensorShard.local_dims``)."""
    activation: Callable[[torch.Tensor], torch.Tensor]
    """The spec's gated activation ``act(gate) * up`` [T, 2I] → [T, I], on the layer's small ops."""
    take: Callable[..., torch.Tensor | None]
    """``take(name[, default])`` pops a canonical checkpoint tensor; without a default a
    missing one raises ``ModelLoadError`` naming it. Whatever is left unpopped at the end of
    loading is refused as unexpected."""
    source: str
    """Where the weights come from (the model folder), for error messages."""
    linear: Callable[[list[str], list[tuple[int, int]]], Any] | None = None
    """``linear(modules, shapes)``: one projection of ``modules`` (canonical names without
    ``.weight``, fused along the output rows; ``shapes`` their ``(out, in)``), stored as the
    checkpoint's quantization method says (a quantized checkpoint's MoE experts)."""
    quantized: bool = False
    """Whether the checkpoint stores projections quantized (``quant/``)."""


@dataclass(frozen=True)
class DecoderSpec:
    """How one family's decoder differs from Llama's (the defaults)."""

    layers: tuple[LayerSpec, ...]
    norm_offset: float = 0.0
    """RMSNorm scales by ``offset + w`` (Gemma: 1, computed in float32)."""
    norms: NormNames = NormNames()
    """The layer's norms by checkpoint name (Gemma's four per layer: sandwich norms after
    attention and after the MLP too)."""
    qk_norm: bool = False
    """Per-head RMSNorm of q and k before rotary (``self_attn.q_norm`` / ``k_norm``)."""
    activation: str = "silu"
    """The gated MLP's activation (``hidden_act`` / ``hidden_activation``)."""
    embed_scale: float | None = None
    """Embeddings times this, in the model dtype (Gemma: ``sqrt(hidden_size)``)."""
    attn_scale: float | None = None
    """Softmax scale (None: ``head_dim ** -0.5``; Gemma: ``query_pre_attn_scalar ** -0.5``)."""
    attn_softcap: float | None = None
    """Attention logits soft-capped as ``cap * tanh(s / cap)`` (None: not capped)."""
    final_softcap: float | None = None
    """Output logits soft-capped likewise (Gemma's ``final_logit_softcapping``)."""
    qkv_bias: bool = False
    """q/k/v biases are required (Qwen2); present ones are always loaded."""
    fused_qkv: str | None = None
    """Checkpoint name of the fused q|k|v projection (Phi-3: ``qkv_proj``); None = split."""
    fused_gate_up: str | None = None
    """Checkpoint name of the fused gate|up projection (Phi-3: ``gate_up_proj``)."""
    rope_layer_types: tuple[str | None, ...] = (None,)
    """The rotary tables to build (``rope_parameters[layer_type]``; None: the flat one)."""
    mlp: Callable[[LayerContext], Any] | None = None
    """Builds a layer's feed-forward block from the checkpoint: ``mlp(ctx)`` returns a
    ``decoder.LayerMLP``, or None for the gated dense MLP in that layer; None here: the dense
    MLP everywhere. The MoE families plug in here (``moe.load_moe_block``)."""

    @property
    def windows(self) -> tuple[int | None, ...]:
        """The distinct sliding windows of the layers (attention metadata is built per window)."""
        return tuple(dict.fromkeys(layer.window for layer in self.layers))


def layer_windows(config) -> list[int | None]:
    """Each layer's sliding window as transformers applies it: ``layer_types`` when the config
    has them (``sliding_attention`` layers get ``sliding_window``), else ``sliding_window`` on
    every layer unless ``use_sliding_window`` is false."""
    n = config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if types:
        return [window if t == "sliding_attention" and window else None for t in types[:n]]
    if not getattr(config, "use_sliding_window", True):
        window = None
    return [window or None] * n
