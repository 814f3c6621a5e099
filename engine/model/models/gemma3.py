"""Gemma 3 text (``Gemma3ForCausalLM``; ``Gemma3ForConditionalGeneration`` checkpoints served
text-only from their ``language_model`` weights, the vision tower left unloaded).

As transformers' ``Gemma3TextModel``: ``(1 + w)`` RMSNorms in float32, four per layer
(before and after attention, before and after the MLP), q/k RMSNorms, GeGLU with the tanh
GELU, embeddings times ``sqrt(hidden_size)`` (in the model dtype), softmax scale
``query_pre_attn_scalar ** -0.5``, the sliding / global pattern of ``layer_types`` (from
``sliding_window_pattern``) with each kind's rotary (``rope_parameters[layer_type]``:
``rope_local_base_freq`` for the sliding layers, the global base and any scaling for the
others), and ``final_logit_softcapping``. ``attn_logit_softcapping`` is not applied: Gemma 3
has none, and transformers' (like Google's) Gemma 3 ignores the field.
"""

from __future__ import annotations

from loramux.engine.errors import ModelLoadError
from loramux.engine.model.models.gemma2 import GEMMA_NORMS
from loramux.engine.model.spec import DecoderSpec, LayerSpec, layer_windows


def decoder_spec(config) -> DecoderSpec:
    if getattr(config, "use_bidirectional_attention", False):
        raise ModelLoadError(
            "Gemma 3 with use_bidirectional_attention (an encoder) is not a causal LM; "
            "loramux serves causal decoders"
        )
    types = list(config.layer_types)
    return DecoderSpec(
        layers=tuple(LayerSpec(w, t) for w, t in zip(layer_windows(config), types, strict=True)),
        norm_offset=1.0,
        norms=GEMMA_NORMS,
        qk_norm=True,
        activation=config.hidden_activation,
        embed_scale=config.hidden_size**0.5,
        attn_scale=config.query_pre_attn_scalar**-0.5,
        final_softcap=config.final_logit_softcapping,
        qkv_bias=bool(config.attention_bias),
        rope_layer_types=tuple(sorted(set(types))),
    )
