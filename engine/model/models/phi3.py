"""Phi-3 / Phi-3.5 / Phi-4 (``Phi3ForCausalLM``): Llama's shape with fused ``qkv_proj`` and
``gate_up_proj`` checkpoints (loaded as they are), ``partial_rotary_factor`` (Phi-4-mini
rotates part of each head), LongRoPE scaling (``longrope``, formerly ``su``: short / long
factors by sequence length, see ``rotary.py``) and an optional sliding window on every layer."""

from __future__ import annotations

from loramux.engine.model.spec import DecoderSpec, LayerSpec, layer_windows


def decoder_spec(config) -> DecoderSpec:
    return DecoderSpec(
        layers=tuple(LayerSpec(w) for w in layer_windows(config)),
        activation=getattr(config, "hidden_act", "silu"),
        fused_qkv="qkv_proj",
        fused_gate_up="gate_up_proj",
    )
