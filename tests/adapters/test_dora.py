"""PEFT DoRA adapters (``use_dora``, ``lora_magnitude_vector``) at upload: accepted with rsLoRA
and partial targets, magnitudes read beside A and B, and refused by name when a magnitude is
missing, misshapen, not finite, too large, or present without ``use_dora``."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from support.lora_fixtures import make_dora_adapter

from loramux.adapters.format import (
    AdapterValidationError,
    load_adapter,
    save_adapter,
    validate_adapter,
)
from loramux.adapters.spec import parse_config

WEIGHTS = "adapter_model.safetensors"
KEY_M = "base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector"


@pytest.fixture(scope="module")
def dora_adapter(tiny_model_dir, tmp_path_factory):
    return make_dora_adapter(tiny_model_dir, tmp_path_factory.mktemp("dora"), r=8,
                             target_modules=["q_proj", "v_proj", "down_proj"], use_rslora=True,
                             layers_to_transform=[1, 0])


@pytest.fixture
def dora_copy(dora_adapter, tmp_path):
    return shutil.copytree(dora_adapter, tmp_path / "dora")


def _edit(folder, fn):
    tensors = load_file(str(folder / WEIGHTS))
    fn(tensors)
    save_file(tensors, str(folder / WEIGHTS))


def test_dora_adapter_accepted_with_its_magnitudes(dora_adapter, tiny_config):
    w = validate_adapter(dora_adapter, tiny_config)
    assert w.spec.use_dora and w.spec.use_rslora and w.spec.kind == "DoRA"
    want = load_file(str(dora_adapter / WEIGHTS))
    assert sorted(w.magnitudes) == [0, 1]
    for layer in (0, 1):
        assert sorted(w.magnitudes[layer]) == ["down_proj", "q_proj", "v_proj"]
        for module, m in w.magnitudes[layer].items():
            parent = "mlp" if module == "down_proj" else "self_attn"
            key = f"base_model.model.model.layers.{layer}.{parent}.{module}.lora_magnitude_vector"
            assert torch.equal(m, want[key])
    assert parse_config({"peft_type": "LORA", "r": 4, "target_modules": ["q_proj"]}).kind == "LoRA"


def test_saved_dora_adapter_round_trips(dora_adapter, tiny_config, tmp_path):
    w = validate_adapter(dora_adapter, tiny_config)
    again = load_adapter(save_adapter(w, tmp_path / "saved"))
    assert again.spec.use_dora
    assert all(torch.equal(again.magnitudes[i][m], t) for i, ms in w.magnitudes.items() for m, t in ms.items())


def test_magnitude_with_weight_suffix_accepted(dora_copy, tiny_config):
    _edit(dora_copy, lambda t: t.__setitem__(KEY_M + ".weight", t.pop(KEY_M)))
    assert 0 in validate_adapter(dora_copy, tiny_config).magnitudes


@pytest.mark.parametrize("change, match", [
    (lambda t: t.pop(KEY_M), f"{KEY_M}: missing tensor"),
    (lambda t: t.__setitem__(KEY_M, torch.ones(7)), r"shape \[7\], expected \[64\]"),
    (lambda t: t[KEY_M].__setitem__(3, float("nan")), "NaN or infinite"),
    (lambda t: t[KEY_M].__setitem__(3, 1e6), "lora_magnitude_vector has values up to 1e\\+06"),
])
def test_bad_magnitudes_refused(dora_copy, tiny_config, change, match):
    _edit(dora_copy, change)
    with pytest.raises(AdapterValidationError, match=match):
        validate_adapter(dora_copy, tiny_config)


def test_magnitude_without_use_dora_refused(dora_copy, tiny_config):
    import json

    cfg = json.loads((dora_copy / "adapter_config.json").read_text())
    cfg["use_dora"] = False
    (dora_copy / "adapter_config.json").write_text(json.dumps(cfg))
    with pytest.raises(AdapterValidationError, match="does not set use_dora"):
        validate_adapter(dora_copy, tiny_config)
