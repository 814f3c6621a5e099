"""One error path: every exception class of the product has its own row in the one table
(status, OpenAI type, metric label), and for real requests through the app the HTTP
answer, the OpenAI client's exception and the ``loramux_requests_total`` label agree."""

from __future__ import annotations

import importlib
import inspect
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from support.platform_settings import ADMIN_KEY, BASE

from loramux.platform.error_handlers import error_table, metric_label, row_of, to_api_error
from loramux.platform.errors import METRIC_LABELS, APIError, BadRequest, ErrorContext

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {"engine": "loramux.engine", "adapters": "loramux.adapters",
            "registry": "loramux.registry", "platform": "loramux.platform"}
OPENAI_TYPES = {"invalid_request_error", "authentication_error", "permission_error",
                "rate_limit_error", "rate_limit_exceeded", "server_error"}


def product_modules() -> list[str]:
    out = []
    for folder, package in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = [p for p in path.relative_to(ROOT / folder).with_suffix("").parts
                     if p != "__init__"]
            out.append(".".join([package, *parts]))
    return out


def product_exceptions() -> list[type[BaseException]]:
    found = []
    for name in product_modules():
        module = importlib.import_module(name)
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if issubclass(cls, BaseException) and cls.__module__ == module.__name__:
                found.append(cls)
    return found


def test_every_product_exception_has_its_own_row():
    classes = product_exceptions()
    assert len(classes) > 40  # the walk found them (engine, adapters, registry, platform)
    table = error_table()
    missing = sorted(f"{c.__module__}.{c.__qualname__}" for c in classes if c not in table)
    assert not missing, f"add a row to platform/error_handlers.py error_table() for {missing}"
    for cls in classes:
        row = table[cls]
        assert 400 <= row.status < 600 and row.type in OPENAI_TYPES, (cls, row)
        assert row.label in METRIC_LABELS and row_of(cls) is row


def test_engine_exceptions_live_in_engine_errors():
    from loramux.engine.errors import EngineError

    for cls in product_exceptions():
        if cls.__module__.startswith("loramux.engine"):
            assert cls.__module__ == "loramux.engine.errors", cls
            assert issubclass(cls, EngineError), cls


def test_api_errors_take_status_and_type_from_the_table():
    err = BadRequest("no", param="x")
    assert (err.status_code, err.type, err.label) == (400, "invalid_request_error", "invalid")
    assert to_api_error(err) is err and metric_label(err) == "invalid"


def test_context_fills_the_prompt_field_and_retry_after():
    from loramux.engine.errors import PromptError, QueueFullError

    ctx = ErrorContext(prompt_param="messages", retry_after=7)
    err = to_api_error(PromptError("the prompt is empty"), ctx)
    assert (err.status_code, err.param, err.code) == (400, "messages", "invalid_parameter")
    full = to_api_error(QueueFullError("the waiting queue is full"), ctx)
    assert full.status_code == 429 and full.headers == {"Retry-After": "7"}
    assert metric_label(QueueFullError("x")) == "rejected"


def test_unexpected_exceptions_are_a_generic_500(caplog):
    err = to_api_error(KeyError("/secret/path"))
    assert err.status_code == 500 and "/secret/path" not in err.message
    assert metric_label(KeyError("x")) == "error"


def test_store_integrity_errors_name_no_key():
    from loramux.registry.errors import ObjectIntegrityError, ObjectNotFound

    for exc in (ObjectNotFound("object 'adapters/sha256/ab12' is missing from /data/objects"),
                ObjectIntegrityError("object 'adapters/sha256/ab12' is corrupt")):
        err = to_api_error(exc)
        assert err.status_code == 500 and "adapters/sha256" not in str(err.body())


# --- through the app, with the official client -------------------------------------------
@pytest.fixture
async def oai(app):
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test",
                             timeout=60)
    async with http:
        yield openai.AsyncOpenAI(base_url="http://test/v1", api_key="unused", http_client=http,
                                 max_retries=0), http


async def _requests_total(http: httpx.AsyncClient, endpoint: str, status: str) -> float:
    r = await http.get("/metrics", headers={"Authorization": f"Bearer {ADMIN_KEY}"})
    for family in text_string_to_metric_families(r.text):
        if family.name == "loramux_requests":
            return sum(s.value for s in family.samples if s.name == "loramux_requests_total"
                       and s.labels["endpoint"] == endpoint and s.labels["status"] == status)
    return 0.0


def _key(env) -> dict[str, str]:
    return {"Authorization": f"Bearer {env.key_a}"}


async def test_prompt_error_answer_client_and_metric_agree(oai, env):
    client, http = oai
    client = client.with_options(api_key=env.key_a)
    before = await _requests_total(http, "completions", "invalid")
    with pytest.raises(openai.BadRequestError) as e:  # a token id past the vocabulary
        await client.completions.create(model=BASE, prompt=[10**6], max_tokens=2)
    assert e.value.status_code == 400
    assert (e.value.type, e.value.code, e.value.param) == (
        "invalid_request_error", "invalid_parameter", "prompt")
    assert await _requests_total(http, "completions", "invalid") == before + 1


async def test_context_length_answer_client_and_metric_agree(oai, env):
    client, http = oai
    client = client.with_options(api_key=env.key_a)
    before = await _requests_total(http, "chat", "invalid")
    with pytest.raises(openai.BadRequestError) as e:
        await client.chat.completions.create(
            model=BASE, messages=[{"role": "user", "content": "hi"}], max_tokens=10_000)
    assert (e.value.code, e.value.param) == ("context_length_exceeded", "max_tokens")
    assert await _requests_total(http, "chat", "invalid") == before + 1


@pytest.mark.parametrize("stream", [False, True])
async def test_queue_full_answer_client_and_metric_agree(oai, env, monkeypatch, stream):
    client, http = oai
    client = client.with_options(api_key=env.key_a)
    monkeypatch.setattr("loramux.engine.engine.queue_full_for", lambda *_a: True)
    before = await _requests_total(http, "completions", "rejected")
    with pytest.raises(openai.RateLimitError) as e:
        await client.completions.create(model=BASE, prompt="hello", max_tokens=2, stream=stream)
    assert e.value.status_code == 429 and e.value.code == "queue_full"
    assert e.value.type == "rate_limit_error"
    assert e.value.response.headers["retry-after"] == "1"  # Settings.retry_after_seconds
    assert await _requests_total(http, "completions", "rejected") == before + 1


async def test_unmapped_body_errors_use_the_same_row_as_fastapi(client, env):
    # the adapter API parses its own JSON bodies: answered by the RequestValidationError row
    r = await client.post("/v1/adapters", headers={**_key(env), "content-type": "application/json"},
                          content=b'{"name": "x"}')
    body = r.json()["error"]
    assert r.status_code == 400 and body["param"] == "source" and body["code"] == "invalid_parameter"
    broken = await client.post("/v1/adapters", headers={**_key(env),
                                                        "content-type": "application/json"},
                               content=b"{not json")
    assert broken.status_code == 400 and broken.json()["error"]["code"] == "invalid_json"


def test_api_error_subclasses_outside_the_table_are_caught():
    class Local(APIError):
        pass

    assert Local("x").status_code == 500  # the base's row; the walk above names it
