"""OpenAI API over a tiny engine (httpx ASGITransport): bodies, presets, errors."""

from __future__ import annotations

import json

from support.platform_settings import BASE
from support.server import parse_sse


async def post(client, env, path, body, key="a"):
    key = {"a": env.key_a, "b": env.key_b, None: None}[key]
    return await client.post(path, json=body, headers=env.headers(key))


async def test_completion_body_and_usage(client, env):
    r = await post(client, env, "/v1/completions",
                   {"model": BASE, "prompt": "Hello there", "max_tokens": 5, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion"
    assert body["id"].startswith("cmpl-") and body["system_fingerprint"].startswith("fp_")
    assert isinstance(body["created"], int) and body["model"] == BASE
    (choice,) = body["choices"]
    assert choice["finish_reason"] == "length" and choice["index"] == 0
    assert body["usage"]["completion_tokens"] == 5
    assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] + 5
    params = json.loads(r.headers["x-loramux-params"])
    assert params["temperature"] == 0.0 and params["max_tokens"] == 5
    assert "x-loramux-preset" not in r.headers
    assert r.headers["x-request-id"]


async def test_greedy_is_deterministic_and_n2(client, env):
    body = {"model": BASE, "prompt": "The capital of France is", "max_tokens": 6, "temperature": 0}
    one = (await post(client, env, "/v1/completions", body)).json()["choices"][0]["text"]
    r = await post(client, env, "/v1/completions", {**body, "n": 2})
    texts = [c["text"] for c in r.json()["choices"]]
    assert texts == [one, one]
    assert [c["index"] for c in r.json()["choices"]] == [0, 1]


async def test_multiple_prompts_index_by_prompt_then_n(client, env):
    r = await post(client, env, "/v1/completions", {
        "model": BASE, "prompt": [[7, 8, 9], [1, 2, 3]], "max_tokens": 3, "n": 2, "temperature": 0.9,
        "seed": 7})
    assert r.status_code == 200, r.text
    assert [c["index"] for c in r.json()["choices"]] == [0, 1, 2, 3]
    assert r.json()["usage"]["completion_tokens"] == 12


async def test_completion_logprobs_shape(client, env):
    r = await post(client, env, "/v1/completions",
                   {"model": BASE, "prompt": "Hi", "max_tokens": 4, "temperature": 0, "logprobs": 3})
    lp = r.json()["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 4
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
    assert "".join(lp["tokens"]) == r.json()["choices"][0]["text"]
    for tok, tlp, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], strict=True):
        assert 3 <= len(top) <= 4 and tok in top and tlp <= 0
        assert tlp == max(top.values())  # greedy picks the top token


async def test_chat_logprobs_shape_and_top_logprobs(client, env):
    r = await post(client, env, "/v1/chat/completions", {
        "model": BASE, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
        "temperature": 0, "logprobs": True, "top_logprobs": 2})
    body = r.json()
    assert body["object"] == "chat.completion"
    msg = body["choices"][0]["message"]
    assert msg["role"] == "assistant"
    content = body["choices"][0]["logprobs"]["content"]
    assert len(content) == 3
    for item in content:
        assert set(item) >= {"token", "logprob", "bytes", "top_logprobs"}
        assert len(item["top_logprobs"]) == 2
        assert item["top_logprobs"][0]["logprob"] >= item["top_logprobs"][1]["logprob"]
        assert item["bytes"] == list(item["token"].encode())
    assert "".join(i["token"] for i in content) == msg["content"]


async def test_chat_stream_with_usage(client, env):
    r = await post(client, env, "/v1/chat/completions", {
        "model": BASE, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 6,
        "temperature": 0, "stream": True, "stream_options": {"include_usage": True}})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = parse_sse(r.text)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 6
    assert all(c["usage"] is None for c in chunks[:-1])
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[:-1])
    finish = [c["choices"][0]["finish_reason"] for c in chunks[:-1]]
    assert finish[-1] == "length" and all(f is None for f in finish[:-1])
    same = await post(client, env, "/v1/chat/completions", {
        "model": BASE, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 6,
        "temperature": 0})
    assert same.json()["choices"][0]["message"]["content"] == text


async def test_completion_stream_matches_non_stream(client, env):
    body = {"model": BASE, "prompt": "One two three", "max_tokens": 8, "temperature": 0}
    plain = (await post(client, env, "/v1/completions", body)).json()["choices"][0]["text"]
    r = await post(client, env, "/v1/completions", {**body, "stream": True})
    events = parse_sse(r.text)
    assert events[-1] == "[DONE]"
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == plain
    assert all("usage" not in e for e in events[:-1])


async def test_echo(client, env):
    r = await post(client, env, "/v1/completions",
                   {"model": BASE, "prompt": "Echo me", "max_tokens": 2, "echo": True})
    assert r.json()["choices"][0]["text"].startswith("Echo me")


async def test_vllm_extension_fields_apply(client, env):
    r = await post(client, env, "/v1/completions", {
        "model": BASE, "prompt": "x", "max_tokens": 4, "temperature": 0.7, "top_k": 5,
        "min_p": 0.05, "repetition_penalty": 1.2, "seed": 3, "stop_token_ids": [5],
        "ignore_eos": True, "min_tokens": 2, "logit_bias": {"42": 5.0}, "best_of": 2,
        "presence_penalty": 0.1, "frequency_penalty": 0.2, "max_completion_tokens": 4})
    assert r.status_code == 200, r.text
    p = json.loads(r.headers["x-loramux-params"])
    assert p["top_k"] == 5 and p["min_p"] == 0.05 and p["repetition_penalty"] == 1.2
    assert p["seed"] == 3 and p["stop_token_ids"] == [5] and p["ignore_eos"] is True
    assert p["min_tokens"] == 2 and p["logit_bias"] == {"42": 5.0} and p["best_of"] == 2
    assert "x-loramux-warnings" not in r.headers


async def test_seeded_sampling_is_reproducible(client, env):
    body = {"model": BASE, "prompt": "Once upon", "max_tokens": 8, "temperature": 1.0, "seed": 11}
    a = (await post(client, env, "/v1/completions", body)).json()["choices"][0]["text"]
    b = (await post(client, env, "/v1/completions", body)).json()["choices"][0]["text"]
    assert a == b


async def test_no_effect_warnings(client, env):
    r = await post(client, env, "/v1/chat/completions", {
        "model": BASE, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2,
        "temperature": 0, "top_p": 0.5, "top_logprobs": 3, "frobnicate": 1,
        "response_format": {"type": "json_object"}})
    assert r.status_code == 200, r.text
    warnings = json.loads(r.headers["x-loramux-warnings"])
    text = " ".join(warnings)
    assert "top_p had no effect" in text and "top_logprobs had no effect" in text
    assert "frobnicate had no effect" in text and "response_format" not in text
    assert r.json()["choices"][0]["logprobs"] is None
    assert r.json()["choices"][0]["message"]["content"].lstrip()[:1] in ("", "{")


async def test_beam_search_over_http_with_warnings(client, env):
    body = {"model": BASE, "prompt": "The capital of France is", "max_tokens": 4, "ignore_eos": True,
            "use_beam_search": True, "n": 2, "best_of": 3, "length_penalty": 0.8, "early_stopping": False,
            "temperature": 0.9, "top_p": 0.5}
    r = await post(client, env, "/v1/completions", body)
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert len(choices) == 2 and all(c["finish_reason"] == "length" for c in choices)
    assert choices[0]["text"] != choices[1]["text"]
    text = " ".join(json.loads(r.headers["x-loramux-warnings"]))
    assert "temperature had no effect: beam search" in text and "top_p had no effect: beam search" in text
    # the same search with other (ignored) sampling parameters gives the same beams
    again = await post(client, env, "/v1/completions", {**body, "temperature": 0.1, "top_p": 1.0})
    assert [c["text"] for c in again.json()["choices"]] == [c["text"] for c in choices]
    plain = await post(client, env, "/v1/completions", {"model": BASE, "prompt": "x", "max_tokens": 1,
                                                         "length_penalty": 2.0})
    assert "length_penalty had no effect: use_beam_search is not set" in plain.headers["x-loramux-warnings"]


async def test_bad_response_format_is_a_400(client, env):
    r = await post(client, env, "/v1/chat/completions", {
        "model": BASE, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2,
        "response_format": {"type": "xml"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format"


async def test_preset_fills_and_request_overrides(client, env):
    r = await post(client, env, "/v1/completions", {"model": "sql-lora", "prompt": "SELECT"})
    assert r.status_code == 200, r.text
    p = json.loads(r.headers["x-loramux-params"])
    assert p["temperature"] == 0.0 and p["stop"] == [";"] and p["max_tokens"] == 12
    assert r.headers["x-loramux-preset"] == "max_tokens,stop,temperature"
    r = await post(client, env, "/v1/completions",
                   {"model": "sql-lora", "prompt": "SELECT", "temperature": 0.5, "stop": ["\n"]})
    p = json.loads(r.headers["x-loramux-params"])
    assert p["temperature"] == 0.5 and p["stop"] == ["\n"] and p["max_tokens"] == 12
    assert r.headers["x-loramux-preset"] == "max_tokens"


async def test_adapter_changes_output(client, env):
    body = {"prompt": "The quick brown fox", "max_tokens": 8, "temperature": 0}
    base = (await post(client, env, "/v1/completions", {**body, "model": BASE})).json()
    lora = (await post(client, env, "/v1/completions", {**body, "model": "a-only"})).json()
    assert base["choices"][0]["text"] != lora["choices"][0]["text"]
    assert lora["model"] == "a-only"


async def test_errors_use_openai_shape(client, env):
    cases = [
        ({"model": BASE, "prompt": "x", "temperature": -1}, 400, "temperature"),
        ({"model": BASE, "prompt": "x", "top_p": 0}, 400, "top_p"),
        ({"model": BASE, "prompt": "x", "n": 2, "best_of": 1}, 400, "best_of"),
        ({"model": BASE, "prompt": "x", "stop_token_ids": [10**9]}, 400, "stop_token_ids"),
        ({"model": BASE, "prompt": "x", "max_tokens": 10_000}, 400, "max_tokens"),
        ({"model": BASE, "prompt": "x", "logprobs": 99}, 400, "logprobs"),
        ({"model": BASE, "prompt": "x", "n": 10**6}, 400, "n"),
        ({"model": BASE, "prompt": "x", "max_tokens": 300, "min_tokens": 300}, 400, "max_tokens"),
        ({"model": BASE, "prompt": "x", "top_k": "many"}, 400, "top_k"),
        ({"model": BASE}, 400, "prompt"),
        ({"model": BASE, "prompt": []}, 400, "prompt"),
        ({"model": "no-such-model", "prompt": "x"}, 404, "model"),
        ({"model": "b-only", "prompt": "x"}, 404, "model"),
    ]
    for body, status, param in cases:
        r = await post(client, env, "/v1/completions", body)
        assert r.status_code == status, (body, r.text)
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}
        assert err["param"] == param, (body, err)
    r = await post(client, env, "/v1/completions", {"model": BASE, "prompt": "x " * 300})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    r = await post(client, env, "/v1/chat/completions", {
        "model": BASE, "messages": [{"role": "user", "content": "x"}], "min_tokens": 10**6})
    assert r.status_code == 400 and r.json()["error"]["param"] == "min_tokens"
    r = await client.post("/v1/completions", content=b"{not json",
                          headers={**env.headers(env.key_a), "content-type": "application/json"})
    assert r.status_code == 400 and "error" in r.json()


async def test_auth(client, env):
    body = {"model": BASE, "prompt": "x", "max_tokens": 1}
    r = await post(client, env, "/v1/completions", body, key=None)
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert r.headers["www-authenticate"] == "Bearer"
    r = await client.post("/v1/completions", json=body, headers={"Authorization": "Bearer lmx_bad"})
    assert r.status_code == 401
    r = await client.get("/v1/models")
    assert r.status_code == 401


async def test_anonymous_access_when_allowed(env):
    import httpx
    from support.platform_settings import settings

    from loramux.platform.app import create_app
    from loramux.platform.state import close_state

    app = create_app(settings(allow_anonymous=True), engine=env.engine, registry=env.registry)
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            r = await c.post("/v1/completions", json={"model": BASE, "prompt": "x", "max_tokens": 1},
                             headers={"Authorization": "Bearer not-used"})
            assert r.status_code == 200
            r = await c.post("/v1/completions", json={"model": "sql-lora", "prompt": "x"})
            assert r.status_code == 404  # tenant adapters always need the tenant's key
            assert [m["id"] for m in (await c.get("/v1/models")).json()["data"]] == [BASE]
    finally:
        close_state(app.services)


async def test_models_list_per_tenant(client, env):
    a = (await client.get("/v1/models", headers=env.headers(env.key_a))).json()
    b = (await client.get("/v1/models", headers=env.headers(env.key_b))).json()
    assert [m["id"] for m in a["data"]] == [BASE, "a-only", "sql-lora"]
    assert [m["id"] for m in b["data"]] == [BASE, "b-only"]
    assert a["data"][1]["parent"] == BASE
    r = await client.get("/v1/models/sql-lora", headers=env.headers(env.key_b))
    assert r.status_code == 404


async def test_body_too_large_is_413(client, env):
    big = {"model": BASE, "prompt": "x" * (9 * 1024 * 1024)}
    r = await post(client, env, "/v1/completions", big)
    assert r.status_code == 413 and r.json()["error"]["code"] == "payload_too_large"


async def test_chat_rejects_non_text_parts(client, env):
    r = await post(client, env, "/v1/chat/completions", {
        "model": BASE, "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "http://x"}}]}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages.0.content"
    r = await post(client, env, "/v1/chat/completions", {
        "model": BASE, "max_tokens": 2, "messages": [{"role": "user", "content": [
            {"type": "text", "text": "hi"}]}]})
    assert r.status_code == 200


async def test_echo_with_logprobs_includes_the_prompt(client, env):
    body = {"model": BASE, "prompt": "one two three", "max_tokens": 3, "temperature": 0,
            "echo": True, "logprobs": 1}
    r = await post(client, env, "/v1/completions", body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    lp = choice["logprobs"]
    n_prompt = r.json()["usage"]["prompt_tokens"]
    assert len(lp["tokens"]) == n_prompt + 3
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(x is not None for x in lp["token_logprobs"][1:])
    assert choice["text"].startswith("one two three")
    events = parse_sse((await post(client, env, "/v1/completions", {**body, "stream": True})).text)
    streamed = [t for e in events[:-1] for t in e["choices"][0]["logprobs"]["tokens"]]
    assert streamed == lp["tokens"]


async def test_prompt_logprobs_extension(client, env):
    r = await post(client, env, "/v1/completions", {"model": BASE, "prompt": "a b c d",
                                                   "max_tokens": 1, "prompt_logprobs": 2})
    assert r.status_code == 200, r.text
    plp = r.json()["choices"][0]["prompt_logprobs"]
    assert len(plp) == r.json()["usage"]["prompt_tokens"] and plp[0] is None
    assert all(2 <= len(e) <= 3 for e in plp[1:])
    r = await post(client, env, "/v1/chat/completions", {
        "model": BASE, "messages": [{"role": "user", "content": "x"}], "max_tokens": 1,
        "prompt_logprobs": 0})
    assert len(r.json()["prompt_logprobs"]) == r.json()["usage"]["prompt_tokens"]
