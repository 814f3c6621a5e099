"""What a quantized checkpoint or ``--quantization`` the engine does not serve is told at start:
a corrupted checkpoint names its tensor, an unsupported scheme names its config field, an
unknown method names the supported ones."""

from __future__ import annotations

import shutil

import pytest
import torch
from support.quant_checkpoints import edit_checkpoint, write_compressed
from support.tiny_models import make_tiny_model

from loramux.engine import LLM
from loramux.engine.config import ModelConfig
from loramux.engine.errors import ModelLoadError

QKV = "model.layers.0.self_attn.q_proj"


@pytest.fixture(scope="module")
def folders(tmp_path_factory, default_model_dir):
    root = tmp_path_factory.mktemp("quant-refusals")
    src = make_tiny_model(root / "float", default_model_dir, "llama")
    return src, write_compressed(src, root / "int4", num_bits=4, group_size=32)


@pytest.fixture
def copy(folders, tmp_path):
    return shutil.copytree(folders[1], tmp_path / "ckpt")


def load(folder, **kw):
    return LLM(str(folder), dtype="float32", device="cpu", max_model_len=64, **kw)


def test_the_checkpoints_method_loads_when_named(folders):
    assert load(folders[1], quantization="compressed-tensors").llm_engine.model.quant.quantized


@pytest.mark.parametrize("name", ["fp8", "bitsandbytes", "nonsense", "gptq_marlin"])
def test_an_unsupported_method_is_refused_naming_the_supported(folders, name):
    with pytest.raises(ValueError, match=f"quantization {name!r} is not supported; supported: "
                                         "compressed-tensors"):
        load(folders[1], quantization=name)
    with pytest.raises(ValueError, match="supported: compressed-tensors"):
        ModelConfig(quantization=name)


def test_a_method_the_checkpoint_lacks_is_refused(folders):
    with pytest.raises(ModelLoadError, match="has no quantization_config"):
        load(folders[0], quantization="compressed-tensors")


def test_a_checkpoint_of_another_method_is_refused(copy):
    edit_checkpoint(copy, config={"quant_method": "bitsandbytes"})
    with pytest.raises(ModelLoadError, match="quant_method 'bitsandbytes' is not supported; "
                                             "supported: compressed-tensors"):
        load(copy)


@pytest.mark.parametrize("tensor", ["weight_scale", "weight_packed", "weight_shape"])
def test_a_missing_tensor_is_named(copy, tensor):
    edit_checkpoint(copy, drop=(f"{QKV}.{tensor}",))
    with pytest.raises(ModelLoadError, match=f"tensor '{QKV}.{tensor}' is missing"):
        load(copy)


def test_an_asymmetric_scheme_without_zero_points_is_named(copy):
    group = {"targets": ["Linear"], "weights": {**WEIGHTS, "symmetric": False}, "format": "pack-quantized"}
    edit_checkpoint(copy, config={"config_groups": {"group_0": group}})
    with pytest.raises(ModelLoadError, match=r"tensor 'model.layers.0.mlp.down_proj.weight_zero_point' "
                                             r"is missing"):
        load(copy)


def test_a_packed_weight_one_column_short_is_named(copy):
    from safetensors.torch import load_file

    packed = load_file(copy / "model.safetensors")[f"{QKV}.weight_packed"]  # [64, 8]
    edit_checkpoint(copy, replace={f"{QKV}.weight_packed": packed[:, :-1].contiguous()})
    with pytest.raises(ModelLoadError, match=rf"tensor {QKV}.weight_packed is torch.int32 \[64, 7\]; "
                                             rf"an int4 \[64, 64\] weight packs to int32 \[64, 8\]"):
        load(copy)


def test_a_wrong_group_size_is_named(copy):
    edit_checkpoint(copy, config={"config_groups": {"group_0": {
        "format": "pack-quantized", "targets": ["Linear"],
        "weights": {"type": "int", "num_bits": 4, "strategy": "group", "group_size": 16,
                    "symmetric": True, "dynamic": False}}}})
    # down_proj [64, 128] loads first: its scale is [64, 4] where group_size 16 needs [64, 8]
    with pytest.raises(ModelLoadError, match=r"tensor model.layers.0.mlp.down_proj.weight_scale is "
                                             r"torch.float32 \[64, 4\]; a group_size 16 scale of a "
                                             r"\[64, 128\] weight is a float \[64, 8\]"):
        load(copy)


def test_a_weight_shape_off_the_config_is_named(copy):
    edit_checkpoint(copy, replace={f"{QKV}.weight_shape": torch.tensor([64, 65])})
    with pytest.raises(ModelLoadError, match=rf"tensor {QKV}.weight_shape is \[64, 65\]"):
        load(copy)


def test_non_finite_scales_are_named(copy):
    from safetensors.torch import load_file

    scale = load_file(copy / "model.safetensors")[f"{QKV}.weight_scale"].clone()
    scale[3, 1] = float("nan")
    edit_checkpoint(copy, replace={f"{QKV}.weight_scale": scale})
    with pytest.raises(ModelLoadError, match=f"tensor {QKV}.weight_scale holds non-finite"):
        load(copy)


WEIGHTS = {"type": "int", "num_bits": 4, "strategy": "group", "group_size": 32, "symmetric": True}


@pytest.mark.parametrize("field, change, why", [
    ("weights.num_bits", {"weights": {**WEIGHTS, "num_bits": 3}}, "supported: 4, 8"),
    ("weights.type", {"weights": {**WEIGHTS, "type": "float", "num_bits": 8}}, "supported: int"),
    ("weights.strategy", {"weights": {**WEIGHTS, "strategy": "tensor"}}, "channel, group"),
    ("weights.actorder", {"weights": {**WEIGHTS, "actorder": "group"}}, "weight_g_idx"),
    ("input_activations", {"input_activations": {"type": "int", "num_bits": 8}}, "activation"),
    ("format", {"format": "int-quantized"}, "supported formats: pack-quantized"),
])
def test_an_unsupported_scheme_is_refused_naming_its_field(copy, field, change, why):
    group = {"targets": ["Linear"], "weights": WEIGHTS, "format": "pack-quantized", **change}
    edit_checkpoint(copy, config={"config_groups": {"group_0": group}})
    with pytest.raises(ModelLoadError, match=rf"quantization_config.config_groups.group_0.{field} "
                                             rf"= .*{why}"):
        load(copy)


def test_fused_parts_with_different_schemes_are_refused(copy):
    edit_checkpoint(copy, config={"ignore": ["lm_head", "re:.*k_proj$"]})
    with pytest.raises(ModelLoadError, match="run fused and need one scheme"):
        load(copy)


def test_a_quantized_moe_family_loads_its_experts_as_stored(tmp_path, default_model_dir):
    """transformers 5 keeps Mixtral's experts as fused parameters, not Linear modules, so the
    library quantizes only the attention: the experts stay float in the checkpoint and load as
    such (per-expert quantized experts: ``test_quant_moe.py``)."""
    src = make_tiny_model(tmp_path / "float", default_model_dir, "mixtral")
    folder = write_compressed(src, tmp_path / "q", num_bits=8, group_size=None,
                              ignore=("lm_head", "re:.*block_sparse_moe.gate$"))
    model = load(folder).llm_engine.model
    assert type(model.layers[0].qkv).__name__ == "QuantLinear"
    assert type(model.layers[0].mlp.gate_up[0]).__name__ == "Linear"
