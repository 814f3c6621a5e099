"""Fixtures of the platform tests: a tiny-model engine with LoRA, a throwaway
registry with two tenants, and an app on top (httpx ASGITransport)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from support.adapters import write_random_adapter
from support.platform_settings import settings
from support.server import make_engine, make_registry

from loramux.platform.app import create_app


@dataclass
class Env:
    """One server's worth of fixtures."""

    engine: object
    registry: object
    key_a: str
    key_b: str
    tenant_a: object
    tenant_b: object
    model_dir: Path
    adapter_dirs: list[Path]

    def headers(self, key: str | None) -> dict[str, str]:
        return {"Authorization": f"Bearer {key}"} if key else {}


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    eng = make_engine(tiny_model_dir, max_model_len=256, max_num_seqs=32, max_waiting=64,
                      max_loras=2, max_cpu_loras=4)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def adapter_dirs(tiny_model_dir, tmp_path_factory) -> list[Path]:
    root = tmp_path_factory.mktemp("adapters")
    return [write_random_adapter(tiny_model_dir, root / f"a{i}", seed=i, std=0.3) for i in range(3)]


@pytest.fixture(scope="module")
def env(engine, tiny_model_dir, adapter_dirs, tmp_path_factory) -> Env:
    registry = make_registry(tmp_path_factory.mktemp("registry"), tiny_model_dir, max_lora_rank=16)
    tenant_a, key_a = registry.create_tenant("alpha")
    tenant_b, key_b = registry.create_tenant("beta")
    registry.upload(tenant_a.id, "sql-lora", adapter_dirs[0],
                    default_preset={"temperature": 0.0, "stop": [";"], "max_tokens": 12})
    registry.upload(tenant_a.id, "a-only", adapter_dirs[1])
    registry.upload(tenant_b.id, "b-only", adapter_dirs[2])
    yield Env(engine, registry, key_a, key_b, tenant_a, tenant_b, tiny_model_dir, adapter_dirs)
    registry.db.dispose()


@pytest.fixture
def app(env):
    app = create_app(settings(), engine=env.engine, registry=env.registry)
    yield app
    from loramux.platform.state import close_state

    close_state(app.services)


@pytest.fixture
async def client(app):
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test",
                                 timeout=60) as c:
        yield c
