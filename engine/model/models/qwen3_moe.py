"""Qwen3-MoE (``Qwen3MoeForCausalLM``): Qwen3's attention (per-head q/k RMSNorms, explicit
``head_dim``, an optional sliding window on every layer) with sparse MoE blocks
(``num_experts`` experts of ``moe_intermediate_size``, top ``num_experts_per_tok``,
renormalised when ``norm_topk_prob``) on the layers ``decoder_sparse_step`` picks and
``mlp_only_layers`` does not keep dense (dense ones: the gated MLP of ``intermediate_size``)."""

from __future__ import annotations

from functools import partial

from loramux.engine.model.moe import ExpertNames, load_moe_block
from loramux.engine.model.spec import DecoderSpec, LayerSpec, layer_windows

EXPERT_NAMES = ExpertNames(("mlp",), "gate_proj", "up_proj", "down_proj")
"""Where the checkpoints keep the block and each expert's projections."""


def decoder_spec(config) -> DecoderSpec:
    return DecoderSpec(
        layers=tuple(LayerSpec(w) for w in layer_windows(config)),
        qk_norm=True,
        activation=getattr(config, "hidden_act", "silu"),
        qkv_bias=bool(getattr(config, "attention_bias", False)),
        mlp=partial(load_moe_block, names=EXPERT_NAMES, norm_topk_prob=bool(config.norm_topk_prob),
                    weights_in_float=False),
    )
