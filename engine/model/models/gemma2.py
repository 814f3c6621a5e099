"""Gemma 2 (``Gemma2ForCausalLM``): Gemma 3's layer without q/k norms — ``(1 + w)`` RMSNorms
in float32, four per layer, GeGLU (tanh), embeddings times ``sqrt(hidden_size)``, softmax scale
``query_pre_attn_scalar ** -0.5``, sliding / global layers (``layer_types``) sharing one rotary
base — plus attention logit soft-capping (``attn_logit_softcapping``) and
``final_logit_softcapping``."""

from __future__ import annotations

from loramux.engine.model.spec import DecoderSpec, LayerSpec, NormNames, layer_windows

GEMMA_NORMS = NormNames(ffn="pre_feedforward_layernorm", attn_out="post_attention_layernorm",
                        ffn_out="post_feedforward_layernorm")
"""Gemma's four norms per layer, by checkpoint name (Gemma 3 has the same)."""


def decoder_spec(config) -> DecoderSpec:
    return DecoderSpec(
        layers=tuple(LayerSpec(w) for w in layer_windows(config)),
        norm_offset=1.0,
        norms=GEMMA_NORMS,
        activation=config.hidden_activation,
        embed_scale=config.hidden_size**0.5,
        attn_scale=config.query_pre_attn_scalar**-0.5,
        attn_softcap=config.attn_logit_softcapping,
        final_softcap=config.final_logit_softcapping,
        qkv_bias=bool(config.attention_bias),
    )
