"""Qwen3 (``Qwen3ForCausalLM``): Llama's shape with a per-head RMSNorm of q and k before
rotary, an explicit ``head_dim`` (q_size need not be the hidden size), no q/k/v bias unless
``attention_bias``, and sliding-window layers where ``use_sliding_window`` /
``max_window_layers`` / ``layer_types`` put them."""

from __future__ import annotations

from loramux.engine.model.spec import DecoderSpec, LayerSpec, layer_windows


def decoder_spec(config) -> DecoderSpec:
    return DecoderSpec(
        layers=tuple(LayerSpec(w) for w in layer_windows(config)),
        qk_norm=True,
        activation=getattr(config, "hidden_act", "silu"),
        qkv_bias=bool(getattr(config, "attention_bias", False)),
    )
