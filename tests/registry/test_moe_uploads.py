"""Uploads against a mixture-of-experts base: an adapter with LoRA on the experts is stored with
its whole size; one trained for another expert count, or whose expert tensors break PEFT's
layout, is refused naming the parameter and the expected shape, and nothing is stored."""

from __future__ import annotations

import json

import pytest
from safetensors.torch import load_file, save_file
from support.lora_fixtures import make_peft_adapter
from support.tiny_models import make_tiny_model
from test_upload_corpus import assert_nothing_stored

EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


@pytest.fixture
def moe(tmp_path, default_model_dir):
    base = make_tiny_model(tmp_path / "base", default_model_dir, "qwen3_moe", num_hidden_layers=2)
    adapter = make_peft_adapter(base, tmp_path / "src" / "a", r=4, target_modules=["q_proj"],
                                target_parameters=EXPERTS, base_model_name_or_path="tiny-moe")
    return base, adapter


@pytest.fixture
def moe_registry(database_url, object_store, tmp_path, moe):
    from loramux.registry import build_registry

    service = build_registry(
        database_url=database_url, data_dir=tmp_path / "data", store=object_store,
        base_model=json.loads((moe[0] / "config.json").read_text()), base_model_name="tiny-moe",
        max_lora_rank=16, max_adapter_bytes=1024 * 1024, auto_upgrade=True,
    )
    yield service
    service.db.dispose()


def test_expert_adapter_is_stored_with_its_size(moe_registry, moe):
    moe_registry.create_tenant("acme")
    handle = moe_registry.upload("acme", "experts", moe[1])
    assert handle.size_bytes == (moe[1] / "adapter_model.safetensors").stat().st_size


def test_an_adapter_for_other_experts_is_refused_and_nothing_stored(moe_registry, moe, tmp_path):
    from loramux.adapters.errors import AdapterValidationError

    moe_registry.create_tenant("acme")
    path = moe[1] / "adapter_model.safetensors"
    t = load_file(str(path))
    key = "base_model.model.model.layers.1.mlp.experts.lora_A.weight"  # down_proj's A [8 * 4, 32]
    t[key] = t[key][:16].contiguous()  # as if for 4 experts
    save_file(t, str(path))
    with pytest.raises(AdapterValidationError, match=r"layers\.1\.mlp\.experts\.lora_A\.weight: shape \[16, 32\], "
                       r"expected \[32, 32\] for mlp\.experts\.down_proj \(8 experts × rank 4"):
        moe_registry.upload("acme", "bad", moe[1])
    assert_nothing_stored(moe_registry, tmp_path)
