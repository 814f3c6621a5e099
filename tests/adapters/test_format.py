"""Reading PEFT adapters: tensor layout, orientation, scale, layers_to_transform."""

from __future__ import annotations

import math

import pytest
import torch
from support.adapters import random_lora

from loramux.adapters.arch import SUPPORTED_MODULES, base_dims
from loramux.adapters.format import (
    AdapterValidationError,
    load_adapter,
    save_adapter,
    validate_adapter,
)
from loramux.adapters.spec import LoraSpec, parse_config


def test_scale():
    spec = LoraSpec(8, 16.0, ("q_proj",), False, False, None)
    assert spec.scale == 2.0
    rs = LoraSpec(16, 16.0, ("q_proj",), True, False, None)
    assert rs.scale == pytest.approx(16 / math.sqrt(16))


def test_load_matches_peft_state(peft_adapter, tiny_config):
    from safetensors.torch import load_file

    w = load_adapter(peft_adapter)
    dims = base_dims(tiny_config)
    assert w.spec.r == 4 and w.spec.lora_alpha == 8.0
    assert w.spec.target_modules == (
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
    )  # fmt: skip
    assert sorted(w.layers) == list(range(dims.num_layers))
    raw = load_file(str(peft_adapter / "adapter_model.safetensors"))
    for layer, modules in w.layers.items():
        for module, (a, b) in modules.items():
            in_f, out_f = dims.module_shape(module)
            assert a.shape == (4, in_f) and b.shape == (out_f, 4)
            parent = (
                "self_attn" if module.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else "mlp"
            )
            prefix = f"base_model.model.model.layers.{layer}.{parent}.{module}"
            assert torch.equal(a, raw[f"{prefix}.lora_A.weight"])
            assert torch.equal(b, raw[f"{prefix}.lora_B.weight"])
    assert w.num_bytes() == sum(t.numel() * 4 for t in raw.values())


def test_delta_matches_peft_forward(tiny_model_dir, peft_adapter):
    """B @ A * scale added to each projection reproduces PEFT's output."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    w = load_adapter(peft_adapter)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    ids = torch.tensor([[1, 5, 9, 200, 33, 7]])
    with torch.no_grad():
        want = PeftModel.from_pretrained(base, peft_adapter).eval()(input_ids=ids).logits
        manual = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
        for layer, modules in w.layers.items():
            block = manual.model.layers[layer]
            for module, (a, b) in modules.items():
                parent = block.self_attn if hasattr(block.self_attn, module) else block.mlp
                getattr(parent, module).weight += w.spec.scale * (b @ a)
        got = manual.eval()(input_ids=ids).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_dtype_conversion(peft_adapter):
    w = load_adapter(peft_adapter, dtype=torch.bfloat16)
    a, b = w.layers[0]["q_proj"]
    assert a.dtype == b.dtype == torch.bfloat16


def test_layers_to_transform(tiny_model_dir, tiny_config, tmp_path, make_adapter):
    path = make_adapter(tiny_model_dir, tmp_path / "a", layers_to_transform=[1])
    w = validate_adapter(path, tiny_config)
    assert list(w.layers) == [1]
    assert w.spec.layers_to_transform == (1,)


def test_qwen2_and_mistral(family_model_dir, make_adapter, tmp_path):
    """Adapters for the other Llama-family architectures, with head_dim * heads != hidden."""
    import json

    config = json.loads((family_model_dir / "config.json").read_text())
    path = make_adapter(
        family_model_dir, tmp_path / "a", target_modules="all-linear", use_rslora=True
    )
    w = validate_adapter(path, config)
    assert w.spec.use_rslora
    assert w.layers[0]["q_proj"][1].shape == (6 * 16, 4)
    assert w.layers[0]["o_proj"][0].shape == (4, 6 * 16)
    assert w.layers[1]["k_proj"][1].shape == (2 * 16, 4)
    assert set(w.layers[1]) == set(SUPPORTED_MODULES)


def test_save_adapter_roundtrip(tiny_config, tmp_path):
    w = random_lora(tiny_config, r=6, target_modules=("k_proj", "down_proj"), use_rslora=True)
    save_adapter(w, tmp_path / "x")
    back = validate_adapter(tmp_path / "x", tiny_config)
    assert back.spec.use_rslora and back.spec.r == 6
    assert back.spec.target_modules == ("k_proj", "down_proj")
    for layer in w.layers:
        for module in w.layers[layer]:
            for x, y in zip(w.layers[layer][module], back.layers[layer][module], strict=True):
                assert torch.equal(x, y)


@pytest.mark.parametrize(
    "targets, expected",
    [
        (
            "all-linear",
            ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
        ),
        (["self_attn.q_proj", "mlp.up_proj"], ("q_proj", "up_proj")),
        ("v_proj", ("v_proj",)),
    ],
)
def test_target_module_forms(targets, expected):
    spec = parse_config({"peft_type": "LORA", "r": 4, "lora_alpha": 4, "target_modules": targets})
    assert spec.target_modules == expected


def test_regex_targets_refused():
    with pytest.raises(AdapterValidationError, match="regular expressions") as e:
        parse_config({"peft_type": "LORA", "r": 4, "target_modules": r".*\.(q|v)_proj"})
    assert e.value.field == "target_modules"
