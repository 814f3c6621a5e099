"""Fuzz the app's own OpenAPI schema with schemathesis: no input yields a 5xx."""

from __future__ import annotations

import zlib

import pytest
import schemathesis
from conftest import ADMIN_KEY, BASE, settings
from hypothesis import HealthCheck, Phase, given
from hypothesis import settings as hsettings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode

from loramux.platform.app import close_state, create_app
from loramux.platform.testing import make_engine, make_registry, write_adapter


@pytest.fixture(scope="module")
def fuzz_env(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz")
    # A short max_model_len bounds how long any generated request can run.
    engine = make_engine(tiny_model_dir, max_model_len=48, max_num_seqs=8, max_loras=2,
                         max_waiting=32)
    registry = make_registry(root / "registry", tiny_model_dir, max_lora_rank=16)
    tenant, key = registry.create_tenant("fuzz")
    registry.upload(tenant.id, "sql-lora", write_adapter(tiny_model_dir, root / "a", seed=3),
                    default_preset={"temperature": 0.0, "stop": [";"]})
    app = create_app(settings(max_upload_bytes=256 * 1024), engine=engine, registry=registry)
    yield app, key
    close_state(app.state.loramux)
    engine.shutdown()
    registry.db.dispose()


def _valid_model(case):
    """Point most inference cases at a real model so generation itself gets fuzzed."""
    if isinstance(case.body, dict) and "model" in case.body:
        pick = zlib.crc32(repr(sorted(case.body, key=str)).encode()) % 4
        if pick < 3:
            case.body["model"] = (BASE, "sql-lora", BASE)[pick]
    return case


def test_no_server_errors(fuzz_env):
    """Positive and negative data for every operation; every answer must be < 500."""
    app, key = fuzz_env
    schema = schemathesis.openapi.from_asgi("/openapi.json", app)
    operations = [r.ok() for r in schema.get_all_operations()]
    assert len(operations) >= 12
    failures: list[str] = []
    calls = 0

    for op in operations:
        token = ADMIN_KEY if op.path.startswith("/admin") else key
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):

            inference = op.path in ("/v1/completions", "/v1/chat/completions")
            strategy = op.as_strategy(generation_mode=mode)
            if inference:
                strategy = strategy.map(_valid_model)

            @given(case=strategy)
            @hsettings(max_examples=40 if inference else 8, deadline=None, derandomize=True, database=None,
                       phases=[Phase.explicit, Phase.generate],
                       suppress_health_check=list(HealthCheck))
            def run(case, token=token):
                nonlocal calls
                calls += 1
                response = case.call(headers={"Authorization": f"Bearer {token}"})
                if response.status_code >= 500:
                    failures.append(f"{case.method} {case.formatted_path} {str(case.body)[:300]!r} "
                                    f"-> {response.status_code} {response.text[:300]}")

            try:
                run()
            except Unsatisfiable:  # nothing to break (e.g. an operation without inputs)
                assert mode is GenerationMode.NEGATIVE, op.label
    assert calls > 100
    assert not failures, "\n".join(failures)
