"""The upload probe: finite but huge adapters are refused, naming the module."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file
from support.adapters import write_random_adapter

from loramux.adapters.errors import AdapterValidationError
from loramux.adapters.format import validate_adapter
from loramux.adapters.probe import probe_adapter


def _scaled(src, factor, key_part="lora_B"):
    weights = src / "adapter_model.safetensors"
    tensors = {k: v * factor if key_part in k and "layers.1.self_attn.v_proj" in k else v
               for k, v in load_file(weights).items()}
    save_file(tensors, weights)
    return src


def test_a_huge_but_finite_adapter_is_refused_naming_the_module(tiny_model_dir, tmp_path):
    import json

    base = json.loads((tiny_model_dir / "config.json").read_text())
    good = write_random_adapter(tiny_model_dir, tmp_path / "good", r=4, std=0.3,
                                target_modules=("q_proj", "v_proj"))
    validate_adapter(good, base)  # a normal adapter passes the probe
    bad = _scaled(write_random_adapter(tiny_model_dir, tmp_path / "bad", r=4, std=0.3,
                                       target_modules=("q_proj", "v_proj")), 1e30)
    with pytest.raises(AdapterValidationError, match="layer 1 v_proj overflows") as info:
        validate_adapter(bad, base)
    assert info.value.field == "weights"


def test_weights_beyond_the_serving_dtype_are_refused_up_front(tiny_model_dir, tmp_path):
    import json

    base = json.loads((tiny_model_dir / "config.json").read_text())
    path = _scaled(write_random_adapter(tiny_model_dir, tmp_path / "big", r=4, std=0.3,
                                        target_modules=("q_proj", "v_proj")), 1e6)
    from loramux.adapters.format import load_adapter

    assert base["hidden_size"]
    weights = load_adapter(path)
    with pytest.raises(AdapterValidationError, match=r"layer 1 v_proj lora_B .* float16 can represent"):
        probe_adapter(weights, torch.float16)
