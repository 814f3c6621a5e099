"""Fixtures of the inference-gateway tests: tiny engines and one registry with two
tenants that both own an adapter named ``shared`` (helpers: ``support/gateway.py``)."""

from __future__ import annotations

import pytest
from support.adapters import write_random_adapter
from support.gateway import Tenants
from support.server import make_engine, make_registry


@pytest.fixture(scope="module")
def tenants(tiny_model_dir, tmp_path_factory) -> Tenants:
    root = tmp_path_factory.mktemp("gw-adapters")
    dirs = [write_random_adapter(tiny_model_dir, root / f"a{i}", seed=10 + i, std=0.3)
            for i in range(4)]
    registry = make_registry(tmp_path_factory.mktemp("gw-registry"), tiny_model_dir,
                             max_lora_rank=16)
    alpha, alpha_key = registry.create_tenant("alpha")
    beta, beta_key = registry.create_tenant("beta")
    registry.upload(alpha.id, "shared", dirs[0])
    registry.upload(alpha.id, "a-only", dirs[1])
    registry.upload(beta.id, "shared", dirs[2])
    registry.upload(beta.id, "b-only", dirs[3])
    yield Tenants(registry, alpha, beta, alpha_key, beta_key, tiny_model_dir, dirs)
    registry.db.dispose()


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    eng = make_engine(tiny_model_dir, max_model_len=512, max_num_seqs=16, max_waiting=64,
                      max_loras=2, max_cpu_loras=6, num_gpu_blocks=512)
    yield eng
    eng.shutdown()
