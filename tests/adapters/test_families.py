"""Upload checks per family (``adapters/arch.py``, the rows of ``adapters/families.py``): each family's PEFT adapters pass against
their base; adapters of another family — by module names, by the decoder's path in the
tensor names, or by what ``base_model_name_or_path`` names — and fused/split spellings that
cannot be mapped are refused with the reason."""

from __future__ import annotations

import json

import pytest
from support.lora_fixtures import make_peft_adapter
from support.tiny_models import make_tiny_model

from loramux.adapters.arch import base_dims, model_types_named
from loramux.adapters.errors import AdapterValidationError
from loramux.adapters.families import ARCHITECTURES, FAMILIES
from loramux.adapters.format import validate_adapter

DIMS = dict(head_dim=16)  # hidden 64, 4 heads of 16, 2 kv heads, intermediate 128: every family alike


@pytest.fixture(scope="module")
def bases(tmp_path_factory, default_model_dir):
    root = tmp_path_factory.mktemp("bases")
    made = {}
    for name, family in (("tiny-qwen3", "qwen3"), ("tiny-gemma3", "gemma3"), ("tiny-gemma3-mm", "gemma3-mm"),
                         ("tiny-phi3", "phi3"), ("tiny-llama", "llama")):
        extra = {} if family in ("phi3", "llama") else DIMS
        made[name] = make_tiny_model(root / name, default_model_dir, family, **extra)
    return made


def config(path) -> dict:
    return json.loads((path / "config.json").read_text())


def edit_config(adapter, **fields):
    path = adapter / "adapter_config.json"
    cfg = json.loads(path.read_text())
    cfg.update(fields)
    path.write_text(json.dumps(cfg))


def refused(adapter, base, *, field: str, match: str) -> AdapterValidationError:
    with pytest.raises(AdapterValidationError) as e:
        validate_adapter(adapter, base)
    assert e.value.field == field, str(e.value)
    assert match in str(e.value), str(e.value)
    return e.value


@pytest.mark.parametrize("name,targets", [
    ("tiny-qwen3", ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
    ("tiny-gemma3", ["q_proj", "v_proj", "down_proj"]),
    ("tiny-phi3", ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]),
])
def test_family_adapters_validate_against_their_base(bases, tmp_path, name, targets):
    adapter = make_peft_adapter(bases[name], tmp_path / "a", r=4, target_modules=targets)
    weights = validate_adapter(adapter, config(bases[name]))
    assert set(weights.layers[0]) == set(targets) and not weights.warnings


def test_multimodal_gemma3_serves_the_text_lora_and_keeps_the_vision_lora(bases, tmp_path):
    base = bases["tiny-gemma3-mm"]
    adapter = make_peft_adapter(base, tmp_path / "a", r=4, target_modules="all-linear")
    weights = validate_adapter(adapter, config(base))
    assert weights.prefix == "model.language_model."
    assert set(weights.layers[1]) == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    assert weights.unserved and all("vision_tower" in n for n in weights.unserved)
    assert any("vision tower" in w for w in weights.warnings)
    # the same adapter on the text-only Gemma 3 of the same dims: another architecture
    refused(adapter, config(bases["tiny-gemma3"]), field="target_modules", match="not a supported target")


def test_text_only_gemma3_adapter_on_the_multimodal_base_is_refused(bases, tmp_path):
    adapter = make_peft_adapter(bases["tiny-gemma3"], tmp_path / "a", r=4)
    edit_config(adapter, base_model_name_or_path=None)
    refused(adapter, config(bases["tiny-gemma3-mm"]),
            field="base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight",
            match="model.language_model.")


def test_phi3_all_linear_means_its_fused_projections(bases, tmp_path):
    adapter = make_peft_adapter(bases["tiny-phi3"], tmp_path / "a", r=4,
                                target_modules=["qkv_proj", "o_proj", "gate_up_proj", "down_proj"])
    edit_config(adapter, target_modules="all-linear")
    weights = validate_adapter(adapter, config(bases["tiny-phi3"]))
    assert weights.spec.target_modules == ("o_proj", "down_proj", "qkv_proj", "gate_up_proj")


def test_split_names_map_onto_phi3_and_fused_plus_split_does_not(bases, tmp_path):
    from support.adapters import write_random_adapter

    base = bases["tiny-phi3"]
    split = write_random_adapter(base, tmp_path / "split", target_modules=("q_proj", "v_proj", "up_proj"),
                                 base_model_name_or_path="microsoft/Phi-3-mini-4k-instruct")
    weights = validate_adapter(split, config(base))
    assert set(weights.layers[0]) == {"q_proj", "v_proj", "up_proj"}
    edit_config(split, target_modules=["q_proj", "v_proj", "up_proj", "qkv_proj"])
    refused(split, config(base), field="target_modules", match="cannot be mapped")


def test_fused_names_on_a_split_family_are_another_family(bases, tmp_path):
    adapter = make_peft_adapter(bases["tiny-phi3"], tmp_path / "a", r=4, target_modules=["qkv_proj"])
    edit_config(adapter, base_model_name_or_path=None)
    for base in ("tiny-llama", "tiny-qwen3"):
        err = refused(adapter, config(bases[base]), field="target_modules", match="qkv_proj")
        assert "another family" in str(err)


def test_same_shapes_of_another_family_are_refused_by_their_base_name(bases, tmp_path):
    adapter = make_peft_adapter(bases["tiny-qwen3"], tmp_path / "a", r=4)
    assert json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"].endswith("tiny-qwen3")
    err = refused(adapter, config(bases["tiny-gemma3"]), field="base_model_name_or_path", match="qwen3")
    assert "Gemma3ForCausalLM" in str(err)
    for hub_name in ("Qwen/Qwen3-8B", "google/gemma-3-4b-it", "meta-llama/Llama-3.2-1B"):
        edit_config(adapter, base_model_name_or_path=hub_name)
        if hub_name.startswith("google"):
            validate_adapter(adapter, config(bases["tiny-gemma3"]))  # its own family: shapes decide
        else:
            refused(adapter, config(bases["tiny-gemma3"]), field="base_model_name_or_path", match=hub_name)
    edit_config(adapter, base_model_name_or_path="my-org/sql-assistant")  # says nothing: shapes decide
    validate_adapter(adapter, config(bases["tiny-gemma3"]))


@pytest.mark.parametrize("name,types", [
    ("Qwen/Qwen3-8B", {"qwen3"}), ("Qwen/Qwen2.5-7B-Instruct", {"qwen2"}), ("Qwen/QwQ-32B", {"qwen2"}),
    ("google/gemma-3-4b-it", {"gemma3_text"}), ("google/gemma-2-9b", {"gemma2"}),
    ("microsoft/Phi-3-mini-4k-instruct", {"phi3"}), ("microsoft/phi-4", {"phi3"}),
    ("microsoft/phi-2", {"phi"}), ("mistralai/Mistral-7B-v0.1", {"mistral"}),
    ("mistralai/Mixtral-8x7B-v0.1", {"mixtral"}), ("meta-llama/Llama-3.1-8B", {"llama"}),
    ("HuggingFaceTB/SmolLM2-135M-Instruct", set()), ("/models/tiny-qwen3", {"qwen3"}), (None, set()),
])
def test_what_a_base_model_name_says(name, types):
    assert model_types_named(name) == types


def test_every_architecture_has_a_family_and_multimodal_dims_come_from_the_text_config():
    assert {a.family for a in ARCHITECTURES.values()} == set(FAMILIES)
    assert all(ARCHITECTURES[a.name] is a for f in FAMILIES.values() for a in f.architectures)
    assert all(f.module == f"loramux.engine.model.models.{f.name}" for f in FAMILIES.values())
    cfg = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
           "text_config": {"model_type": "gemma3_text", "hidden_size": 2560, "intermediate_size": 10240,
                           "num_hidden_layers": 34}}  # as gemma-3-4b-it leaves out the defaults
    dims = base_dims(cfg)
    assert (dims.num_heads, dims.num_kv_heads, dims.head_dim) == (8, 4, 256)
    assert dims.family.name == "gemma3" and dims.arch.peft_prefix == "model.language_model."
    with pytest.raises(AdapterValidationError, match="Qwen3ForCausalLM"):
        base_dims({"architectures": ["GPTNeoXForCausalLM"], "model_type": "gpt_neox"})
