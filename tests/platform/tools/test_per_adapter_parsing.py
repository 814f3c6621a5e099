"""An adapter's own chat template and parsers apply to its requests only: in one batch a
base row (the server has no parsers) and the adapter's row are rendered and parsed each
their own way."""

from __future__ import annotations

import asyncio

import pytest
from support.forced_text import regex_literal
from support.platform_settings import settings

from loramux.platform.app import create_app

TEMPLATE = ("{% for t in tools or [] %}[tool {{ t.function.name }}]{% endfor %}"
            "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>")
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}
TEXT = '<think>hmm</think><tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'


@pytest.fixture
def app(env):
    """The platform app, its grammars constraining the thought too (the forced texts
    write one)."""
    app = create_app(settings(structured_outputs_config='{"enable_in_reasoning": true}'),
                     engine=env.engine, registry=env.registry)
    yield app
    from loramux.platform.state import close_state

    close_state(app.services)


def _body(model: str, **kw) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": "Weather?"}],
            "tools": [WEATHER], "max_tokens": 60, "temperature": 0,
            "structured_outputs": {"regex": regex_literal(TEXT)}, **kw}


async def test_adapter_parsers_and_template_beside_base_rows(client, env):
    auth = env.headers(env.key_a)
    r = await client.patch("/v1/adapters/a-only", headers=auth, json={
        "chat_template": TEMPLATE, "tool_call_parser": "hermes", "reasoning_parser": "olmo3"})
    assert r.status_code == 200, r.text
    base_model = (await client.get("/v1/models", headers=auth)).json()["data"][0]["id"]
    adapter, base, base_auto = await asyncio.gather(
        client.post("/v1/chat/completions", headers=auth, json=_body("a-only")),
        client.post("/v1/chat/completions", headers=auth, json=_body(base_model, tool_choice="none")),
        client.post("/v1/chat/completions", headers=auth, json=_body(base_model)),
    )
    assert adapter.status_code == 200, adapter.text
    msg = adapter.json()["choices"][0]["message"]
    assert msg["reasoning"] == "hmm" and msg["content"] is None
    assert [c["function"]["name"] for c in msg["tool_calls"]] == ["get_weather"]
    assert adapter.json()["choices"][0]["finish_reason"] == "tool_calls"
    rendered = "[tool get_weather]<user>Weather?<assistant>"
    expected = len(env.engine.tokenizer(rendered, add_special_tokens=False).input_ids)
    assert adapter.json()["usage"]["prompt_tokens"] == expected
    assert base.status_code == 200, base.text
    assert base.json()["choices"][0]["message"]["content"] == TEXT  # no parsers for the base
    assert base.json()["choices"][0]["message"]["tool_calls"] == []
    assert base.json()["usage"]["prompt_tokens"] != expected
    assert base_auto.status_code == 400 and base_auto.json()["error"]["param"] == "tool_choice"
    r = await client.patch("/v1/adapters/a-only", headers=auth, json={
        "chat_template": None, "tool_call_parser": None, "reasoning_parser": None})
    assert r.status_code == 200, r.text
    again = await client.post("/v1/chat/completions", headers=auth, json=_body("a-only"))
    assert again.status_code == 400  # auto tool choice without a parser again
