"""Fuzz the app's own OpenAPI schema with schemathesis: no input yields a 5xx."""

from __future__ import annotations

import zlib

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given
from hypothesis import settings as hsettings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from support.adapters import write_random_adapter
from support.platform_settings import ADMIN_KEY, BASE, settings
from support.server import make_engine, make_registry

from loramux.platform.app import create_app
from loramux.platform.state import close_state


@pytest.fixture(scope="module")
def fuzz_env(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz")
    # A short max_model_len bounds how long any generated request can run.
    engine = make_engine(tiny_model_dir, max_model_len=48, max_num_seqs=8, max_loras=2,
                         max_waiting=32)
    registry = make_registry(root / "registry", tiny_model_dir, max_lora_rank=16)
    tenant, key = registry.create_tenant("fuzz")
    registry.upload(tenant.id, "sql-lora", write_random_adapter(tiny_model_dir, root / "a", seed=3),
                    default_preset={"temperature": 0.0, "stop": [";"]})
    app = create_app(settings(max_upload_bytes=256 * 1024), engine=engine, registry=registry)
    yield app, key
    close_state(app.services)
    engine.shutdown()
    registry.db.dispose()


def _valid_model(case):
    """Point most inference cases at a real model so generation itself gets fuzzed."""
    if isinstance(case.body, dict) and "model" in case.body:
        pick = zlib.crc32(repr(sorted(case.body, key=str)).encode()) % 4
        if pick < 3:
            case.body["model"] = (BASE, "sql-lora", BASE)[pick]
            # Random output constraints are mostly invalid (400); keep them in a quarter of
            # the cases so generation itself is reached in the rest.
            for name in _CONSTRAINTS:
                case.body.pop(name, None)
    return case


_CONSTRAINTS = ("response_format", "structured_outputs", "guided_json", "guided_regex",
                "guided_choice", "guided_grammar")


def _fuzz(strategy, token: str, examples: int, failures: list[str], calls: list):
    """One hypothesis run of an operation's strategy; 5xx answers go to ``failures``."""

    @given(case=strategy)
    @hsettings(max_examples=examples, deadline=None, derandomize=True, database=None,
               phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    def run(case):
        response = case.call(headers={"Authorization": f"Bearer {token}"})
        calls.append((case.path, response.status_code))
        if response.status_code >= 500:
            failures.append(f"{case.method} {case.formatted_path} {str(case.body)[:300]!r} "
                            f"-> {response.status_code} {response.text[:300]}")

    run()


def test_no_server_errors(fuzz_env):
    """Positive and negative data for every operation; every answer must be < 500."""
    app, key = fuzz_env
    schema = schemathesis.openapi.from_asgi("/openapi.json", app)
    operations = [r.ok() for r in schema.get_all_operations()]
    assert len(operations) >= 12
    failures: list[str] = []
    calls: list[tuple[str, int]] = []
    for op in operations:
        token = ADMIN_KEY if op.path.startswith("/admin") else key
        inference = op.path in ("/v1/completions", "/v1/chat/completions")
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            strategy = op.as_strategy(generation_mode=mode)
            if inference:
                strategy = strategy.map(_valid_model)
            try:
                _fuzz(strategy, token, 64 if inference else 8, failures, calls)
            except Unsatisfiable:  # nothing to break (e.g. an operation without inputs)
                assert mode is GenerationMode.NEGATIVE, op.label
    assert len(calls) > 100
    import collections  # noqa: E401
    import os

    seen = collections.Counter(calls)
    if os.environ.get("FUZZ_STATS"):
        print(sorted(seen.items()))
    # generation itself was fuzzed, not only the validation in front of it
    for path in ("/v1/completions", "/v1/chat/completions"):
        assert seen[(path, 200)] >= 5, sorted(seen.items())
    assert not failures, "\n".join(failures)


def _sampling_bodies(vocab: int):
    """Request bodies whose fields are mostly in range, so the engine itself gets fuzzed."""
    from hypothesis import strategies as st

    token = st.integers(0, vocab - 1)
    fields = {
        "temperature": st.floats(0, 3), "top_p": st.floats(0.01, 1), "top_k": st.integers(-1, 200),
        "min_p": st.floats(0, 1), "presence_penalty": st.floats(-2, 2),
        "frequency_penalty": st.floats(-2, 2), "repetition_penalty": st.floats(0.1, 3),
        "seed": st.integers(-(2**63), 2**63 - 1), "stop": st.lists(st.text(min_size=1, max_size=3), max_size=3),
        "stop_token_ids": st.lists(token, max_size=3), "ignore_eos": st.booleans(),
        "max_tokens": st.integers(1, 24), "min_tokens": st.integers(0, 8),
        "logit_bias": st.dictionaries(token.map(str), st.floats(-100, 100), max_size=4),
        "allowed_token_ids": st.lists(token, min_size=1, max_size=5), "n": st.integers(1, 3),
        "best_of": st.integers(1, 4), "include_stop_str_in_output": st.booleans(),
        "skip_special_tokens": st.booleans(), "stream": st.booleans(),
        "prompt_logprobs": st.integers(0, 3),
    }
    common = st.fixed_dictionaries({}, optional=fields)
    completion = st.tuples(common, st.fixed_dictionaries({}, optional={
        "logprobs": st.integers(0, 5), "echo": st.booleans(),
        "prompt": st.one_of(st.text(min_size=1, max_size=40), st.lists(token, min_size=1, max_size=20),
                            st.lists(st.text(min_size=1, max_size=10), min_size=1, max_size=3))}))
    chat = st.tuples(common, st.fixed_dictionaries({}, optional={
        "logprobs": st.booleans(), "top_logprobs": st.integers(0, 5),
        "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()})}))
    return completion, chat


def test_no_server_errors_with_valid_sampling(fuzz_env):
    """In-range sampling parameters in every combination: the engine never answers 5xx."""
    from hypothesis import strategies as st
    from starlette.testclient import TestClient

    app, key = fuzz_env
    vocab = app.services.engine.engine.model.dims.vocab_size
    completion, chat = _sampling_bodies(vocab)
    headers = {"Authorization": f"Bearer {key}"}
    failures: list[str] = []
    ok = []
    with TestClient(app, raise_server_exceptions=False) as client:

        @given(body=completion, model=st.sampled_from([BASE, "sql-lora"]))
        @hsettings(max_examples=60, deadline=None, derandomize=True, database=None,
                   suppress_health_check=list(HealthCheck), phases=[Phase.explicit, Phase.generate])
        def completions(body, model):
            payload = {**body[0], **body[1], "model": model}
            payload.setdefault("prompt", "hello")
            r = client.post("/v1/completions", json=payload, headers=headers)
            ok.append(r.status_code == 200)
            if r.status_code >= 500 or 'data: {"error"' in r.text:
                failures.append(f"{payload} -> {r.status_code} {r.text[:300]}")

        @given(body=chat, model=st.sampled_from([BASE, "sql-lora"]))
        @hsettings(max_examples=60, deadline=None, derandomize=True, database=None,
                   suppress_health_check=list(HealthCheck), phases=[Phase.explicit, Phase.generate])
        def chats(body, model):
            payload = {**body[0], **body[1], "model": model,
                       "messages": [{"role": "user", "content": "hi"}]}
            r = client.post("/v1/chat/completions", json=payload, headers=headers)
            ok.append(r.status_code == 200)
            if r.status_code >= 500 or 'data: {"error"' in r.text:
                failures.append(f"{payload} -> {r.status_code} {r.text[:300]}")

        completions()
        chats()
    assert not failures, "\n".join(failures[:10])
    assert sum(ok) >= 40, sum(ok)  # most bodies were served, so generation was exercised
    assert app.services.engine.is_ready
