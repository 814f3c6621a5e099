"""AWQ and GPTQ checkpoints the engine cannot serve are refused at start with a
``ModelLoadError`` naming the tensor or the ``quantization_config`` field: a missing tensor,
a packed tensor of the wrong shape, a group size that does not divide the input features,
unsupported bits or layouts, ``desc_act`` without ``g_idx``, a ``g_idx`` that is not a
grouping."""

from __future__ import annotations

import shutil

import pytest
import torch
from awq_gptq_layouts import write_awq, write_gptq
from support.quant_checkpoints import edit_checkpoint
from support.tiny_models import make_tiny_model

from loramux.engine import LLM
from loramux.engine.errors import ModelLoadError

Q = "model.layers.0.self_attn.q_proj"
DOWN = "model.layers.0.mlp.down_proj"


@pytest.fixture(scope="module")
def folders(tmp_path_factory, default_model_dir):
    root = tmp_path_factory.mktemp("awq-gptq-refusals")
    src = make_tiny_model(root / "float", default_model_dir, "llama")
    return {"float": src, "awq": write_awq(src, root / "awq", group_size=32),
            "gptq": write_gptq(src, root / "gptq", group_size=32, desc_act=True)}


@pytest.fixture(params=["awq", "gptq"])
def fmt(request):
    return request.param


@pytest.fixture
def copy(folders, fmt, tmp_path):
    return shutil.copytree(folders[fmt], tmp_path / "ckpt")


def load(folder, **kw):
    return LLM(str(folder), dtype="float32", device="cpu", max_model_len=64, **kw)


def tensor(folder, name):
    from safetensors.torch import load_file

    return load_file(folder / "model.safetensors")[name]


def test_each_loads_when_named_and_the_other_name_is_refused(folders, fmt):
    assert load(folders[fmt], quantization=fmt).llm_engine.model.quant.name == fmt
    other = "gptq" if fmt == "awq" else "awq"
    with pytest.raises(ModelLoadError, match=f"quantization='{other}' does not match the "
                                             f"checkpoint's quant_method '{fmt}'"):
        load(folders[fmt], quantization=other)
    with pytest.raises(ModelLoadError, match="has no quantization_config"):
        load(folders["float"], quantization=fmt)


@pytest.mark.parametrize("suffix", ["qweight", "qzeros", "scales"])
def test_a_missing_tensor_is_named(copy, suffix):
    edit_checkpoint(copy, drop=(f"{Q}.{suffix}",))
    with pytest.raises(ModelLoadError, match=f"tensor '{Q}.{suffix}' is missing"):
        load(copy)


def test_desc_act_without_g_idx_is_named(folders, tmp_path):
    copy = shutil.copytree(folders["gptq"], tmp_path / "ckpt")
    edit_checkpoint(copy, drop=(f"{Q}.g_idx",))
    with pytest.raises(ModelLoadError, match=f"tensor '{Q}.g_idx' is missing"):
        load(copy)


def test_a_g_idx_that_is_not_a_grouping_is_named(folders, tmp_path):
    copy = shutil.copytree(folders["gptq"], tmp_path / "ckpt")
    g_idx = tensor(copy, f"{Q}.g_idx").clone()
    g_idx[:3] = 0  # group 0 gains columns another group loses
    g_idx[g_idx.ne(0).nonzero()[0]] = 0
    edit_checkpoint(copy, replace={f"{Q}.g_idx": g_idx})
    with pytest.raises(ModelLoadError, match=rf"tensor {Q}.g_idx does not give every group 32 columns"):
        load(copy)


def test_a_packed_weight_off_by_one_is_named(copy, fmt):
    q = tensor(copy, f"{Q}.qweight")  # awq [64, 8], gptq [8, 64]
    edit_checkpoint(copy, replace={f"{Q}.qweight": q[:, :-1].contiguous()})
    want = r"\[64, 7\]; .* \[out, in\] = \[64, 64\]" if fmt == "awq" else r"\[8, 63\]; .* = \[64, 64\]"
    with pytest.raises(ModelLoadError, match=rf"tensor {Q}.qweight is .*{want}"):
        load(copy)


def test_a_group_size_not_dividing_is_named(copy):
    edit_checkpoint(copy, config={"group_size": 48})
    with pytest.raises(ModelLoadError, match=rf"tensor {DOWN}.scales group_size 48 does not "
                                             r"divide the 128 input features"):
        load(copy)


def test_scales_of_another_group_size_are_named(copy, fmt):
    edit_checkpoint(copy, config={"group_size": 16})
    want = r"\[4, 64\]; a float \[8, 64\]"  # down_proj [64, 128]: 4 groups stored, 8 declared
    with pytest.raises(ModelLoadError, match=rf"tensor {DOWN}.scales is torch.float16 {want}"):
        load(copy)


def test_non_finite_scales_are_named(copy):
    scales = tensor(copy, f"{Q}.scales").clone()
    scales[1, 3] = float("inf")
    edit_checkpoint(copy, replace={f"{Q}.scales": scales})
    with pytest.raises(ModelLoadError, match=f"tensor {Q}.scales holds non-finite"):
        load(copy)


@pytest.mark.parametrize("fmt, field, value, why", [
    ("awq", "bits", 8, "4-bit weights only"),
    ("awq", "version", "gemv", "supported: gemm"),
    ("awq", "group_size", 0, "a positive integer or -1"),
    ("gptq", "bits", 3, "supported: 4, 8"),
    ("gptq", "checkpoint_format", "marlin", "supported: gptq, gptq_v2"),
    ("gptq", "pack_dtype", "int16", "supported: int32"),
    ("gptq", "dynamic", {"-:.*down_proj": {}}, "per-module overrides"),
])
def test_an_unsupported_field_is_named(folders, tmp_path, fmt, field, value, why):
    copy = shutil.copytree(folders[fmt], tmp_path / "ckpt")
    edit_checkpoint(copy, config={field: value})
    with pytest.raises(ModelLoadError, match=rf"quantization_config.{field} = .*{why}"):
        load(copy)


def test_zero_points_of_the_wrong_shape_are_named(copy):
    z = tensor(copy, f"{Q}.qzeros")  # [2, 8]
    edit_checkpoint(copy, replace={f"{Q}.qzeros": torch.cat([z, z]).contiguous()})
    with pytest.raises(ModelLoadError, match=rf"tensor {Q}.qzeros is torch.int32 \[4, 8\]; "
                                             r"int32 \[2, 8\] is required"):
        load(copy)
