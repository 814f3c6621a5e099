"""FP8 compressed-tensors checkpoints the engine cannot serve are refused at start naming the
tensor (missing, wrong dtype or shape, non-finite scales) or the config field (other widths,
groups, blocks, integer weights in a float format, static activation scales)."""

from __future__ import annotations

import shutil

import pytest
from fp8_checkpoints import write_fp8
from safetensors.torch import load_file
from support.quant_checkpoints import edit_checkpoint
from support.tiny_models import make_tiny_model

from loramux.engine import LLM
from loramux.engine.errors import ModelLoadError

Q = "model.layers.0.self_attn.q_proj"
WEIGHTS = {"type": "float", "num_bits": 8, "strategy": "channel", "symmetric": True, "dynamic": False}


@pytest.fixture(scope="module")
def fp8_folder(tmp_path_factory, default_model_dir):
    root = tmp_path_factory.mktemp("fp8-refusals")
    src = make_tiny_model(root / "float", default_model_dir, "llama")
    return write_fp8(src, root / "fp8", strategy="channel")


@pytest.fixture
def copy(fp8_folder, tmp_path):
    return shutil.copytree(fp8_folder, tmp_path / "ckpt")


@pytest.mark.parametrize("drop", ["weight", "weight_scale"])
def test_a_missing_tensor_is_named(copy, drop):
    edit_checkpoint(copy, drop=(f"{Q}.{drop}",))
    with pytest.raises(ModelLoadError, match=f"tensor '{Q}.{drop}' is missing"):
        LLM(str(copy), dtype="float32", device="cpu", max_model_len=64)


@pytest.mark.parametrize("tensor, value, why", [
    ("weight", lambda t: t.float(), r"is torch.float32 \[64, 64\]; the scheme stores float8_e4m3fn"),
    ("weight", lambda t: t[:, :-1].contiguous(), r"is \[64, 63\]; the model's config makes"),
    ("weight_scale", lambda t: t[:-1].contiguous(), r"is torch.float32 \[63, 1\]; a per-channel"),
    ("weight_scale", lambda t: t.clone().fill_(float("nan")), "holds non-finite"),
])
def test_a_bad_tensor_is_named(copy, tensor, value, why):
    t = load_file(copy / "model.safetensors")[f"{Q}.{tensor}"]
    edit_checkpoint(copy, replace={f"{Q}.{tensor}": value(t)})
    with pytest.raises(ModelLoadError, match=rf"tensor {Q}.{tensor} {why}"):
        LLM(str(copy), dtype="float32", device="cpu", max_model_len=64)


@pytest.mark.parametrize("field, change, why", [
    ("weights.num_bits", {"weights": {**WEIGHTS, "num_bits": 4}}, "supported: 8"),
    ("weights.strategy", {"weights": {**WEIGHTS, "strategy": "group", "group_size": 32}},
     "supported: tensor, channel"),
    ("weights.strategy", {"weights": {**WEIGHTS, "strategy": "block",  # DeepSeek-style blocks
                                      "block_structure": [128, 128]}}, "'block': supported"),
    ("weights.type", {"weights": {**WEIGHTS, "type": "int"}}, "integer weights: pack-quantized"),
    ("input_activations.dynamic", {"input_activations": {"type": "float", "num_bits": 8,
                                                         "strategy": "tensor", "dynamic": False}},
     "static activation scales"),
])
def test_an_unsupported_fp8_scheme_is_named(copy, field, change, why):
    group = {"targets": ["Linear"], "weights": WEIGHTS, "format": "float-quantized", **change}
    edit_checkpoint(copy, config={"config_groups": {"group_0": group}})
    with pytest.raises(ModelLoadError, match=rf"config_groups.group_0.{field} = .*{why}"):
        LLM(str(copy), dtype="float32", device="cpu", max_model_len=64)
