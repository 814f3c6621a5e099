"""Llama, Mistral and Qwen2 (``LlamaForCausalLM``, ``MistralForCausalLM``, ``Qwen2ForCausalLM``):
the reference shape every default of :class:`DecoderSpec` describes — RMSNorm before attention
and MLP, split q/k/v and gate/up checkpoints fused at load, SiLU-gated MLP, rotary of any
``rope_type``, an optional sliding window (Mistral on every layer; Qwen2 on the layers its
``layer_types`` say), q/k/v biases on Qwen2."""

from __future__ import annotations

from loramux.engine.model.spec import DecoderSpec, LayerSpec, layer_windows


def decoder_spec(config) -> DecoderSpec:
    return DecoderSpec(
        layers=tuple(LayerSpec(w) for w in layer_windows(config)),
        activation=getattr(config, "hidden_act", "silu"),
        qkv_bias=config.model_type == "qwen2" or bool(getattr(config, "attention_bias", False)),
    )
