"""The bad-input corpus for adapters: each case is refused with its documented error."""

from __future__ import annotations

import json
import os
import pickle
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from loramux.adapters.arch import SUPPORTED_MODULES
from loramux.adapters.format import AdapterValidationError, load_adapter, validate_adapter

KEY_A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
KEY_B = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"
WEIGHTS = "adapter_model.safetensors"
CONFIG = "adapter_config.json"


class MarkerPayload:
    """Unpickling this would create ``path`` (it never must)."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def edit_config(folder: Path, **changes) -> None:
    cfg = json.loads((folder / CONFIG).read_text())
    for k, v in changes.items():
        if v is ...:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (folder / CONFIG).write_text(json.dumps(cfg))


def edit_tensors(folder: Path, fn) -> None:
    tensors = load_file(str(folder / WEIGHTS))
    fn(tensors)
    save_file(tensors, str(folder / WEIGHTS))


def refused(path, config, field=None, match=None, **kwargs) -> AdapterValidationError:
    with pytest.raises(AdapterValidationError, match=match) as e:
        validate_adapter(path, config, **kwargs)
    if field is not None:
        assert e.value.field == field, str(e.value)
    return e.value


def test_valid(adapter_copy, tiny_config):
    w = validate_adapter(adapter_copy, tiny_config)
    assert w.spec.r == 4 and not w.warnings


# -- pickles ------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["adapter_model.bin", "adapter_model.pt", "weights.pth", "x.pkl"])
def test_pickle_file_in_folder(adapter_copy, tiny_config, tmp_path, name):
    marker = tmp_path / "pwned"
    (adapter_copy / name).write_bytes(pickle.dumps(MarkerPayload(marker)))
    err = refused(adapter_copy, tiny_config, field=name, match="pickle")
    assert "safetensors" in str(err) and "save_pretrained" in str(err)
    with pytest.raises(AdapterValidationError):
        load_adapter(adapter_copy)
    assert not marker.exists()


def test_pickle_bytes_named_safetensors(adapter_copy, tiny_config, tmp_path):
    marker = tmp_path / "pwned"
    (adapter_copy / WEIGHTS).write_bytes(pickle.dumps({"w": MarkerPayload(marker)}, protocol=4))
    refused(adapter_copy, tiny_config, field=WEIGHTS, match="pickle")
    assert not marker.exists()


def test_torch_save_zip_named_safetensors(adapter_copy, tiny_config, tmp_path):
    marker = tmp_path / "pwned"
    torch.save({"w": MarkerPayload(marker)}, adapter_copy / WEIGHTS)
    refused(adapter_copy, tiny_config, field=WEIGHTS, match="pickle")
    assert not marker.exists()


def test_single_pickle_upload(tiny_config, tmp_path):
    marker = tmp_path / "pwned"
    path = tmp_path / "adapter.pkl"
    path.write_bytes(pickle.dumps(MarkerPayload(marker)))
    refused(path, tiny_config, match="pickle")
    odd = tmp_path / "adapter.upload"
    odd.write_bytes(pickle.dumps(MarkerPayload(marker)))
    refused(odd, tiny_config, match="pickle")
    assert not marker.exists()


def test_only_bin_weights(adapter_copy, tiny_config, tmp_path):
    (adapter_copy / WEIGHTS).unlink()
    (adapter_copy / "adapter_model.bin").write_bytes(pickle.dumps({"a": 1}))
    refused(adapter_copy, tiny_config, match="pickle")


# -- config -------------------------------------------------------------------------


def test_invalid_json(adapter_copy, tiny_config):
    (adapter_copy / CONFIG).write_text("{'r': 4,")
    refused(adapter_copy, tiny_config, field=CONFIG, match="invalid JSON")


def test_config_not_object(adapter_copy, tiny_config):
    (adapter_copy / CONFIG).write_text("[1, 2]")
    refused(adapter_copy, tiny_config, field=CONFIG, match="JSON object")


@pytest.mark.parametrize("which", [CONFIG, WEIGHTS])
def test_empty_file(adapter_copy, tiny_config, which):
    (adapter_copy / which).write_bytes(b"")
    refused(adapter_copy, tiny_config, field=which, match="empty")


@pytest.mark.parametrize("which", [CONFIG, WEIGHTS])
def test_missing_file(adapter_copy, tiny_config, which):
    (adapter_copy / which).unlink()
    refused(adapter_copy, tiny_config, field=which, match="missing")


def test_empty_upload_file(tiny_config, tmp_path):
    path = tmp_path / "adapter.zip"
    path.write_bytes(b"")
    refused(path, tiny_config, match="empty")


@pytest.mark.parametrize(
    "changes, field, match",
    [
        ({"peft_type": "LOHA"}, "peft_type", "expected 'LORA'"),
        ({"peft_type": ...}, "peft_type", "expected 'LORA'"),
        ({"modules_to_save": "lm_head"}, "modules_to_save", "expected a list of module names"),
        ({"bias": "lora_only"}, "bias", "expected 'none'"),
        ({"bias": "all"}, "bias", "expected 'none'"),
        ({"lora_bias": True}, "lora_bias", "lora_bias"),
        ({"rank_pattern": {"q_proj": 8}}, "rank_pattern", "per-module"),
        ({"alpha_pattern": {"q_proj": 8}}, "alpha_pattern", "per-module"),
        # declared vocabulary parts (adapters/vocab.py) whose tensors are missing
        ({"target_modules": [*SUPPORTED_MODULES, "lm_head"]}, "lm_head.lora_A.weight", "missing"),
        ({"target_modules": [*SUPPORTED_MODULES, "embed_tokens"]}, "embed_tokens.lora_embedding_A", "missing"),
        ({"target_modules": ["attn.c_attn"]}, "target_modules", "not a supported"),
        ({"target_modules": []}, "target_modules", "non-empty"),
        ({"target_modules": ".*proj"}, "target_modules", "regular expressions"),
        ({"r": 0}, "r", "positive integer"),
        ({"r": "4"}, "r", "positive integer"),
        ({"lora_alpha": float("nan")}, "lora_alpha", "positive number"),
        ({"layers_to_transform": [0, 7]}, "layers_to_transform", "does not exist"),
        ({"layers_pattern": "h"}, "layers_pattern", "expected 'layers'"),
        ({"trainable_token_indices": [1, 2]}, "embed_tokens.token_adapter.trainable_tokens_delta", "missing"),
        ({"trainable_token_indices": {"lm_head": [1, 1]}}, "trainable_token_indices", "repeat"),
        ({"layer_replication": [[0, 1]]}, "layer_replication", "not supported"),
    ],
)
def test_config_refusals(adapter_copy, tiny_config, changes, field, match):
    edit_config(adapter_copy, **changes)
    refused(adapter_copy, tiny_config, field=field, match=match)


def test_rank_above_limit(adapter_copy, tiny_config):
    err = refused(
        adapter_copy, tiny_config, field="r", match="above max_lora_rank", max_lora_rank=2
    )
    assert "rank 4" in str(err)


# -- tensors ------------------------------------------------------------------------


def test_nan_weights(adapter_copy, tiny_config):
    edit_tensors(adapter_copy, lambda t: t[KEY_B].__setitem__((0, 0), float("nan")))
    refused(adapter_copy, tiny_config, field=KEY_B, match="NaN or infinite")
    with pytest.raises(AdapterValidationError, match="NaN"):
        load_adapter(adapter_copy)


def test_inf_weights_fp16(adapter_copy, tiny_config):
    def f(t):
        t[KEY_A] = t[KEY_A].half()
        t[KEY_A][1, 1] = float("inf")

    edit_tensors(adapter_copy, f)
    refused(adapter_copy, tiny_config, field=KEY_A, match="NaN or infinite")


def test_wrong_shape(adapter_copy, tiny_config):
    edit_tensors(adapter_copy, lambda t: t.__setitem__(KEY_B, torch.zeros(100, 4)))
    err = refused(
        adapter_copy, tiny_config, field=KEY_B, match=r"shape \[100, 4\], expected \[64, 4\]"
    )
    assert "trained on" not in str(err)


def test_rank_mismatch_between_config_and_tensors(adapter_copy, tiny_config):
    edit_config(adapter_copy, r=8)
    refused(adapter_copy, tiny_config, field=KEY_A, match=r"expected \[8, 64\]")


def test_missing_tensor(adapter_copy, tiny_config):
    edit_tensors(adapter_copy, lambda t: t.pop(KEY_B))
    refused(adapter_copy, tiny_config, field=KEY_B, match="missing tensor")


def test_missing_module_everywhere(adapter_copy, tiny_config):
    def drop(t):
        for k in [k for k in t if ".gate_proj." in k]:
            del t[k]

    edit_tensors(adapter_copy, drop)
    refused(adapter_copy, tiny_config, match="gate_proj.lora_A.weight: missing tensor")


def test_stray_tensor(adapter_copy, tiny_config):
    edit_tensors(adapter_copy, lambda t: t.__setitem__("lm_head.weight", torch.zeros(2, 2)))
    refused(adapter_copy, tiny_config, field="lm_head.weight", match="unexpected tensor")


def test_tensor_for_untargeted_module(adapter_copy, tiny_config):
    edit_config(adapter_copy, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    err = refused(adapter_copy, tiny_config, match="not in target_modules")
    assert "mlp" in err.field


def test_tensor_beyond_layers(adapter_copy, tiny_config):
    key = "base_model.model.model.layers.5.self_attn.q_proj.lora_A.weight"
    edit_tensors(adapter_copy, lambda t: t.__setitem__(key, torch.zeros(4, 64)))
    refused(adapter_copy, tiny_config, field=key, match="2 layers")


def test_integer_dtype(adapter_copy, tiny_config):
    edit_tensors(
        adapter_copy, lambda t: t.__setitem__(KEY_A, torch.zeros(4, 64, dtype=torch.int32))
    )
    refused(adapter_copy, tiny_config, field=KEY_A, match="float dtype")


def test_half_precision_accepted(adapter_copy, tiny_config):
    edit_tensors(adapter_copy, lambda t: t.update({k: v.bfloat16() for k, v in t.items()}))
    w = validate_adapter(adapter_copy, tiny_config)
    assert w.layers[0]["q_proj"][0].dtype == torch.float32


def test_oversized(adapter_copy, tiny_config):
    size = (adapter_copy / WEIGHTS).stat().st_size
    refused(adapter_copy, tiny_config, field="size", match="above the limit", max_bytes=size - 1)
    validate_adapter(adapter_copy, tiny_config, max_bytes=size)


def test_huge_header(adapter_copy, tiny_config):
    (adapter_copy / WEIGHTS).write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    refused(adapter_copy, tiny_config, field=WEIGHTS, match="above the")


def test_garbage_header(adapter_copy, tiny_config):
    (adapter_copy / WEIGHTS).write_bytes(struct.pack("<Q", 4) + b"\xff\xfe{}" + b"\0" * 16)
    refused(adapter_copy, tiny_config, field=WEIGHTS, match="not valid JSON")


def test_offsets_outside_data(adapter_copy, tiny_config):
    header = json.dumps({KEY_A: {"dtype": "F32", "shape": [4, 64], "data_offsets": [0, 1024]}})
    raw = header.encode()
    (adapter_copy / WEIGHTS).write_bytes(struct.pack("<Q", len(raw)) + raw + b"\0" * 100)
    refused(adapter_copy, tiny_config, field=KEY_A, match="outside")


def test_truncated_file(adapter_copy, tiny_config):
    data = (adapter_copy / WEIGHTS).read_bytes()
    (adapter_copy / WEIGHTS).write_bytes(data[:-10])
    with pytest.raises(AdapterValidationError):
        validate_adapter(adapter_copy, tiny_config)


# -- base model -----------------------------------------------------------------------


def test_other_base_name_is_a_warning(adapter_copy, tiny_config):
    edit_config(adapter_copy, base_model_name_or_path="meta-llama/Llama-3.2-1B")
    w = validate_adapter(adapter_copy, tiny_config, base_model_name="org/tiny-llama")
    assert len(w.warnings) == 1 and "Llama-3.2-1B" in w.warnings[0]


def test_other_base_name_with_wrong_shapes_is_an_error(adapter_copy, tiny_config):
    edit_config(adapter_copy, base_model_name_or_path="meta-llama/Llama-3.2-1B")
    bigger = dict(tiny_config, hidden_size=128, intermediate_size=256)
    err = refused(bigger and adapter_copy, bigger, match="shape", base_model_name="org/big")
    assert "trained on 'meta-llama/Llama-3.2-1B'" in str(err)


def test_same_base_name_by_last_component(adapter_copy, tiny_config):
    edit_config(adapter_copy, base_model_name_or_path="/models/SmolLM2-135M-Instruct")
    w = validate_adapter(
        adapter_copy, tiny_config, base_model_name="HuggingFaceTB/SmolLM2-135M-Instruct"
    )
    assert not w.warnings


def test_unsupported_base_architecture(adapter_copy, tiny_config):
    refused(adapter_copy, dict(tiny_config, model_type="gpt2"), field="model_type", match="gpt2")


def test_pretrained_config_accepted(adapter_copy, tiny_model_dir):
    from transformers import AutoConfig

    validate_adapter(adapter_copy, AutoConfig.from_pretrained(tiny_model_dir))


def test_per_layer_module_paths(adapter_copy, tiny_config):
    """PEFT writes full module paths for some models; tensors must match them exactly."""
    edit_config(
        adapter_copy,
        target_modules=[
            f"model.layers.{i}.{p}.{m}"
            for i in range(2)
            for p, ms in (
                ("self_attn", "q_proj k_proj v_proj o_proj"),
                ("mlp", "gate_proj up_proj down_proj"),
            )
            for m in ms.split()
        ],
    )
    w = validate_adapter(adapter_copy, tiny_config)
    assert len(w.spec.target_modules) == 7 and len(w.spec.module_layers) == 14

    def drop_layer1_q(t):
        for k in [k for k in t if "layers.1.self_attn.q_proj" in k]:
            del t[k]

    edit_tensors(adapter_copy, drop_layer1_q)
    refused(adapter_copy, tiny_config, match="layers.1.self_attn.q_proj.lora_A.weight: missing")
    cfg = json.loads((adapter_copy / CONFIG).read_text())
    cfg["target_modules"].remove("model.layers.1.self_attn.q_proj")
    (adapter_copy / CONFIG).write_text(json.dumps(cfg))
    w = validate_adapter(adapter_copy, tiny_config)
    assert "q_proj" in w.layers[0] and "q_proj" not in w.layers[1]


def test_source_missing(tiny_config, tmp_path):
    refused(tmp_path / "nope", tiny_config, field="source", match="no such")


def test_symlink_in_folder(adapter_copy, tiny_config, tmp_path):
    secret = tmp_path / "secret.safetensors"
    os.replace(adapter_copy / WEIGHTS, secret)
    (adapter_copy / WEIGHTS).symlink_to(secret)
    refused(adapter_copy, tiny_config, field=WEIGHTS, match="links are refused")
