"""The official ``openai`` client against a live loramux server on loopback."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from support.adapters import write_random_adapter
from support.server import make_engine, make_registry, serve_in_thread

from loramux.platform.app import create_app
from loramux.platform.settings import Settings
from loramux.platform.state import close_state

BASE = "tiny-base"


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("openai-client")
    engine = make_engine(tiny_model_dir, max_model_len=256, max_num_seqs=16, max_loras=2)
    registry = make_registry(root / "registry", tiny_model_dir)
    tenant, key = registry.create_tenant("acme")
    registry.upload(tenant.id, "sql-lora", write_random_adapter(tiny_model_dir, root / "sql", seed=1, std=0.3),
                    default_preset={"temperature": 0.0, "stop": [";"]})
    too_big = write_random_adapter(tiny_model_dir, root / "rank32", seed=2, r=32)
    settings = Settings(served_model_name=[BASE], max_request_bytes=64 * 1024,
                        lora_modules=[f"rank32={too_big}"], max_lora_rank=16)
    app = create_app(settings, engine=engine, registry=registry)
    with serve_in_thread(app) as url:
        yield url, key
    close_state(app.services)
    engine.shutdown()
    registry.db.dispose()


@pytest.fixture
def client(server):
    url, key = server
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=60)


def test_models_list(client):
    ids = [m.id for m in client.models.list()]
    assert ids == [BASE, "sql-lora", "rank32"]
    assert client.models.retrieve("sql-lora").id == "sql-lora"


def test_chat_completion(client):
    out = client.chat.completions.create(
        model=BASE, messages=[{"role": "user", "content": "Hello!"}], max_tokens=8, temperature=0)
    assert out.object == "chat.completion" and out.choices[0].message.role == "assistant"
    assert out.usage.completion_tokens == 8 and out.system_fingerprint
    assert out.choices[0].finish_reason == "length"


def test_chat_streaming_matches(client):
    kwargs = dict(model=BASE, messages=[{"role": "user", "content": "Count"}], max_tokens=8,
                  temperature=0)
    full = client.chat.completions.create(**kwargs).choices[0].message.content
    stream = client.chat.completions.create(**kwargs, stream=True,
                                            stream_options={"include_usage": True})
    parts, usage = [], None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            parts.append(c.delta.content or "")
    assert "".join(parts) == full
    assert usage is not None and usage.completion_tokens == 8


def test_completions_streaming_and_n2(client):
    out = client.completions.create(model=BASE, prompt="San Francisco is a", max_tokens=7,
                                    temperature=0, n=2)
    assert len(out.choices) == 2 and out.choices[0].text == out.choices[1].text
    text = "".join(c.choices[0].text for c in client.completions.create(
        model=BASE, prompt="San Francisco is a", max_tokens=7, temperature=0, stream=True))
    assert text == out.choices[0].text


def test_logprobs(client):
    out = client.completions.create(model=BASE, prompt="x", max_tokens=3, temperature=0, logprobs=2)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 3
    chat = client.chat.completions.create(
        model=BASE, messages=[{"role": "user", "content": "x"}], max_tokens=3, temperature=0,
        logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == 3 and all(len(c.top_logprobs) == 2 for c in content)
    assert content[0].logprob == content[0].top_logprobs[0].logprob


def test_extra_body_fields(client):
    raw = client.completions.with_raw_response.create(
        model=BASE, prompt="x", max_tokens=5, temperature=0.8,
        extra_body={"top_k": 3, "min_p": 0.1, "repetition_penalty": 1.3, "seed": 5,
                    "ignore_eos": True, "min_tokens": 5, "stop_token_ids": [7],
                    "include_stop_str_in_output": False, "best_of": 2})
    params = json.loads(raw.headers["x-loramux-params"])
    assert params["top_k"] == 3 and params["min_p"] == 0.1 and params["repetition_penalty"] == 1.3
    assert params["seed"] == 5 and params["ignore_eos"] and params["min_tokens"] == 5
    assert params["stop_token_ids"] == [7] and params["best_of"] == 2
    assert raw.parse().usage.completion_tokens == 5


def test_adapter_preset(client):
    raw = client.completions.with_raw_response.create(model="sql-lora", prompt="SELECT", max_tokens=4)
    assert raw.headers["x-loramux-preset"] == "stop,temperature"
    assert raw.parse().model == "sql-lora"


def test_error_classes(client, server):
    url, _ = server
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=BASE, prompt="x", temperature=-1)
    assert e.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=BASE, prompt="x " * 300, max_tokens=10)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0).models.list()
    with pytest.raises(openai.APIStatusError) as e:
        client.completions.create(model=BASE, prompt="y" * 100_000)
    assert e.value.status_code == 413
    with pytest.raises(openai.UnprocessableEntityError):
        client.completions.create(model="rank32", prompt="x", max_tokens=2)


def test_rate_limit_and_unavailable(tiny_model_dir):
    """A full waiting queue is a 429 with Retry-After; a stopped engine is a 503."""
    engine = make_engine(tiny_model_dir, max_model_len=256, max_num_seqs=1, max_waiting=1,
                         enable_lora=False)
    app = create_app(Settings(served_model_name=[BASE], allow_anonymous=True, retry_after_seconds=2),
                     engine=engine)
    try:
        with serve_in_thread(app) as url:
            import concurrent.futures

            def one(_):
                return httpx.post(f"{url}/v1/completions", timeout=60, json={
                    "model": BASE, "prompt": "x", "max_tokens": 40, "ignore_eos": True})

            with concurrent.futures.ThreadPoolExecutor(8) as pool:
                responses = list(pool.map(one, range(8)))
            codes = sorted(r.status_code for r in responses)
            assert codes.count(200) >= 2 and 429 in codes, codes
            limited = next(r for r in responses if r.status_code == 429)
            assert limited.headers["retry-after"] == "2"
            assert limited.json()["error"]["type"] == "rate_limit_error"
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
            with pytest.raises(openai.RateLimitError):
                with concurrent.futures.ThreadPoolExecutor(8) as pool:
                    futs = [pool.submit(client.completions.create, model=BASE, prompt="x",
                                        max_tokens=40, extra_body={"ignore_eos": True})
                            for _ in range(8)]
                    for f in futs:
                        f.result()
            engine.shutdown()
            with pytest.raises(openai.InternalServerError) as e:
                client.completions.create(model=BASE, prompt="x", max_tokens=1)
            assert e.value.status_code == 503
    finally:
        close_state(app.services)
        engine.shutdown()
