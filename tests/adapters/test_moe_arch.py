"""The MoE families in the one architecture table: expert dimensions from the config as
transformers builds the layers, checkpoint names, and uploads refused where an MoE layer has no
dense MLP."""

from __future__ import annotations

import pytest

from loramux.adapters.arch import ATTENTION_MODULES, base_dims, family_mismatch, model_types_named
from loramux.adapters.errors import AdapterValidationError
from loramux.adapters.families import (
    Architecture,
    ModelFamily,
    MoEKeys,
    register_family,
    unregister_family,
)

QWEN3_MOE = dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", hidden_size=64,
                 intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=6,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
                 num_experts_per_tok=2, decoder_sparse_step=2, mlp_only_layers=[3])
MIXTRAL = dict(architectures=["MixtralForCausalLM"], model_type="mixtral", hidden_size=64,
               intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               num_local_experts=4, num_experts_per_tok=2)


def test_expert_dims_follow_transformers_layer_choice():
    d = base_dims(QWEN3_MOE)
    assert (d.num_experts, d.num_experts_per_tok, d.moe_intermediate_size) == (8, 2, 32)
    assert d.moe_layers == (1, 5)  # (i + 1) % 2 == 0, layer 3 kept dense
    assert d.has_module(3, "gate_proj") and not d.has_module(1, "down_proj") and d.has_module(1, "q_proj")
    m = base_dims(MIXTRAL)
    assert (m.num_experts, m.moe_intermediate_size, m.moe_layers) == (4, 48, (0, 1))
    assert m.family.lora_modules == ("q_proj", "k_proj", "v_proj", "o_proj")


def test_an_moe_family_row_names_its_own_config_fields():
    """The experts' dimensions come from the fields the family's row names (no family is
    special-cased): a row registered here, with field names no built-in family uses."""
    row = ModelFamily("acme_moe", "Acme-MoE", "acme_moe_engine_module",
                      (Architecture("AcmeMoeForCausalLM", "acme_moe"),), ATTENTION_MODULES,
                      moe=MoEKeys(("n_routed_experts",), "expert_ffn", top_k="experts_per_token",
                                  sparse_step="moe_every", dense_layers="dense_ones"))
    cfg = dict(architectures=["AcmeMoeForCausalLM"], model_type="acme_moe", hidden_size=64,
               intermediate_size=128, num_hidden_layers=6, num_attention_heads=4, n_routed_experts=6,
               expert_ffn=16, experts_per_token=2, moe_every=2, dense_ones=[3])
    register_family(row)
    try:
        d = base_dims(cfg)
        assert (d.num_experts, d.num_experts_per_tok, d.moe_intermediate_size) == (6, 2, 16)
        assert d.moe_layers == (1, 5) and d.family.name == "acme_moe"
        with pytest.raises(AdapterValidationError, match="experts_per_token 7 exceeds the 6 experts"):
            base_dims({**cfg, "experts_per_token": 7})
    finally:
        unregister_family("acme_moe")
    with pytest.raises(AdapterValidationError, match="not supported"):
        base_dims(cfg)


def test_top_k_beyond_the_experts_is_refused():
    with pytest.raises(AdapterValidationError, match="num_experts_per_tok 9 exceeds the 8 experts"):
        base_dims({**QWEN3_MOE, "num_experts_per_tok": 9})


@pytest.mark.parametrize(("name", "types"), [
    ("Qwen/Qwen3-30B-A3B", {"qwen3_moe"}), ("Qwen/Qwen3-235B-A22B-Instruct-2507", {"qwen3_moe"}),
    ("Qwen/Qwen3-8B", {"qwen3"}), ("mistralai/Mixtral-8x7B-v0.1", {"mixtral"}),
])
def test_checkpoint_names(name, types):
    assert model_types_named(name) == types


def test_a_dense_qwen3_adapter_is_told_apart_from_an_moe_base():
    d = base_dims({**QWEN3_MOE, "_name_or_path": "Qwen/Qwen3-30B-A3B"})
    assert family_mismatch("Qwen/Qwen3-8B", d, "Qwen/Qwen3-30B-A3B") is not None
    assert family_mismatch("Qwen/Qwen3-30B-A3B-Base", d, "Qwen/Qwen3-30B-A3B") is None


def test_expert_lora_saves_back_as_peft_wrote_it(tmp_path, default_model_dir):
    """``save_adapter`` writes the experts' LoRA in PEFT's layout (names, A expert-major, B
    rank-major) and per-parameter ranks: the round trip gives PEFT's tensors back."""
    from safetensors.torch import load_file
    from support.lora_fixtures import make_peft_adapter
    from support.tiny_models import make_tiny_model

    from loramux.adapters.format import load_adapter, save_adapter

    base = make_tiny_model(tmp_path / "m", default_model_dir, "qwen3_moe", num_hidden_layers=2)
    adapter = make_peft_adapter(base, tmp_path / "a", r=4, target_modules=None, seed=1,
                                target_parameters=["mlp.experts.gate_up_proj"],
                                rank_pattern={".*\\.gate_up_proj": 8}, alpha_pattern={".*\\.gate_up_proj": 4})
    weights = load_adapter(adapter)
    assert weights.spec.parameter_ranks == (("gate_up_proj", 8, 4.0),)
    assert weights.spec.expert_scale("gate_up_proj") == 0.5
    a, b = weights.experts[0]["gate_up_proj"]
    assert a.shape == (8, 8, 64) and b.shape == (8, 64, 8)
    out = save_adapter(weights, tmp_path / "b")
    want, got = load_file(adapter / "adapter_model.safetensors"), load_file(out / "adapter_model.safetensors")
    assert want.keys() == got.keys() and all((want[k] == got[k]).all() for k in want)
    again = load_adapter(out)
    assert again.spec.parameter_ranks == weights.spec.parameter_ranks
    assert again.spec.target_modules == ()


def test_transformers_4_per_expert_lora_is_refused_with_the_way_out():
    from loramux.adapters.spec import parse_config

    with pytest.raises(AdapterValidationError, match="save it again, which writes target_parameters"):
        parse_config({"peft_type": "LORA", "r": 4, "target_modules": ["q_proj", "w1", "w2"]}, base_dims(MIXTRAL))
