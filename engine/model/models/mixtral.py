"""Mixtral (``MixtralForCausalLM``): Mistral's attention (an optional sliding window on every
layer, explicit ``head_dim`` where given) with a sparse MoE block on every layer
(``num_local_experts`` experts of ``intermediate_size``, top ``num_experts_per_tok``, always
renormalised, outputs scaled by the float32 routing weights), from checkpoints naming the
block ``block_sparse_moe`` (experts ``w1`` / ``w3`` / ``w2``) or transformers 5's fused
``mlp.experts``."""

from __future__ import annotations

from functools import partial

from loramux.engine.model.moe import ExpertNames, load_moe_block
from loramux.engine.model.spec import DecoderSpec, LayerSpec, layer_windows

EXPERT_NAMES = ExpertNames(("mlp", "block_sparse_moe"), "w1", "w3", "w2")
"""Where the checkpoints keep the block (``mlp``, older ones ``block_sparse_moe``) and each
expert's projections (``w1`` the gate, ``w3`` the up, ``w2`` the down projection)."""


def decoder_spec(config) -> DecoderSpec:
    return DecoderSpec(
        layers=tuple(LayerSpec(w) for w in layer_windows(config)),
        activation=getattr(config, "hidden_act", "silu"),
        mlp=partial(load_moe_block, names=EXPERT_NAMES, norm_topk_prob=True, weights_in_float=True),
    )
