"""A Qwen3 base served end to end: its adapters upload and serve; adapters of another family
(named by base_model_name_or_path, or by Phi-3's fused module names) and wrong shapes are
refused at upload with 422 naming the reason, and nothing is stored; /v1/models and the
dashboard show the base model's family."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from support.lora_fixtures import make_peft_adapter
from support.platform_settings import ADMIN_KEY, settings
from support.server import make_engine, make_registry
from support.tiny_models import make_tiny_model

from loramux.platform.app import create_app
from loramux.platform.state import close_state
from loramux.registry.service import OBJECT_PREFIX

SAME_DIMS = dict(head_dim=16)  # every tiny family below: hidden 64, 4 heads of 16, 2 kv heads


@pytest.fixture(scope="module")
def models(tmp_path_factory, default_model_dir) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    return {
        "qwen3": make_tiny_model(root / "tiny-qwen3", default_model_dir, "qwen3", **SAME_DIMS),
        "gemma3": make_tiny_model(root / "tiny-gemma3", default_model_dir, "gemma3", **SAME_DIMS),
        "phi3": make_tiny_model(root / "tiny-phi3", default_model_dir, "phi3"),
        "qwen3-big": make_tiny_model(root / "tiny-qwen3-big", default_model_dir, "qwen3", head_dim=16,
                                     intermediate_size=96),
    }


@pytest.fixture(scope="module")
def env(models, tmp_path_factory):
    engine = make_engine(models["qwen3"], max_model_len=128, max_loras=2)
    registry = make_registry(tmp_path_factory.mktemp("registry"), models["qwen3"])
    tenant, key = registry.create_tenant("alpha")
    yield engine, registry, key
    registry.db.dispose()
    engine.shutdown()


@pytest.fixture
async def client(env):
    engine, registry, _ = env
    app = create_app(settings(), engine=engine, registry=registry)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test",
                                 timeout=60) as c:
        yield c
    close_state(app.services)


def _files(folder: Path) -> list:
    return [("file", (n, (folder / n).read_bytes()))
            for n in ("adapter_config.json", "adapter_model.safetensors")]


async def test_family_checks_at_upload(client, env, models, tmp_path):
    _, registry, key = env
    h = {"Authorization": f"Bearer {key}"}
    refusals = {
        # same shapes, another architecture: told by base_model_name_or_path (a gemma3 folder)
        "gemma": (make_peft_adapter(models["gemma3"], tmp_path / "g", r=4, seed=1),
                  "base_model_name_or_path", ["gemma3", "Qwen3ForCausalLM"]),
        # Phi-3's fused names: a Qwen3 has no qkv_proj
        "phi": (make_peft_adapter(models["phi3"], tmp_path / "p", r=4, target_modules=["qkv_proj"]),
                "target_modules", ["qkv_proj", "q_proj"]),
        # a Qwen3 of another intermediate size: the module and the expected shape
        "shape": (make_peft_adapter(models["qwen3-big"], tmp_path / "s", r=4, target_modules=["down_proj"]),
                  "base_model.model.model.layers.0.mlp.down_proj.lora_A.weight", ["[4, 128]"]),
    }
    for name, (folder, param, words) in refusals.items():
        r = await client.post("/v1/adapters", files=_files(folder), headers=h, data={"name": name})
        assert r.status_code == 422, (name, r.text)
        err = r.json()["error"]
        assert err["param"] == param, (name, err)
        for word in words:
            assert word in err["message"], (name, err["message"])
    assert list(registry.store.list(OBJECT_PREFIX)) == [] and registry.list(registry.get_tenant("alpha").id) == []

    good = make_peft_adapter(models["qwen3"], tmp_path / "q", r=8, target_modules=["q_proj", "v_proj", "down_proj"])
    r = await client.post("/v1/adapters", files=_files(good), headers=h, data={"name": "qwen3-lora"})
    assert r.status_code == 201, r.text
    r = await client.post("/v1/completions", headers=h,
                          json={"model": "qwen3-lora", "prompt": "Hello", "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3

    cards = {c["id"]: c for c in (await client.get("/v1/models", headers=h)).json()["data"]}
    assert cards["qwen3-lora"]["family"] == "qwen3 (Qwen3ForCausalLM)"
    assert {c["family"] for c in cards.values()} == {"qwen3 (Qwen3ForCausalLM)"}
    overview = await client.get("/admin/overview", headers={"Authorization": f"Bearer {ADMIN_KEY}"})
    assert overview.json()["base_family"] == "qwen3 (Qwen3ForCausalLM)"
