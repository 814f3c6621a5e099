"""Tool calling and reasoning on /v1/chat/completions through the official ``openai``
client against a live server. The tiny random model's text is forced with a regex
(``structured_outputs``) so the parsers see the formats the models document."""

from __future__ import annotations

import json

import openai
import pytest
from support.server import make_engine, serve_in_thread

from loramux.platform.app import create_app
from loramux.platform.settings import Settings
from loramux.platform.state import close_state

BASE = "tiny-base"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "days": {"type": "integer"}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}}}}
HERMES_TWO = ('Let me check.<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", '
              '"days": 2}}</tool_call><tool_call>{"name": "get_time", "arguments": {"tz": "CET"}}'
              '</tool_call>')


def _regex(text: str) -> str:
    import re

    return re.escape(text)


def _forced(text: str) -> dict:
    return {"structured_outputs": {"regex": _regex(text)}}


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    eng = make_engine(tiny_model_dir, max_model_len=512, max_num_seqs=16)
    yield eng
    eng.shutdown()


def _serve(engine, **kw):
    settings = Settings(served_model_name=[BASE], allow_anonymous=True, **kw)
    return create_app(settings, engine=engine, registry=None)


@pytest.fixture(scope="module")
def hermes(engine):
    app = _serve(engine, enable_auto_tool_choice=True, tool_call_parser="hermes",
                 reasoning_parser="qwen3",  # the forced texts constrain the thought too:
                 structured_outputs_config='{"enable_in_reasoning": true}')
    with serve_in_thread(app) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
    close_state(app.services)


def _chat(client, text: str, **kw):
    kw.setdefault("tools", [WEATHER, TIME])
    return client.chat.completions.create(
        model=BASE, messages=[{"role": "user", "content": "Weather in Paris?"}],
        max_tokens=120, temperature=0, extra_body=_forced(text), **kw)


def _stream(client, text: str, **kw):
    kw.setdefault("tools", [WEATHER, TIME])
    return list(client.chat.completions.create(
        model=BASE, messages=[{"role": "user", "content": "Weather in Paris?"}],
        max_tokens=120, temperature=0, extra_body=_forced(text), stream=True, **kw))


def _rebuild(chunks) -> tuple[str, str, list[dict], str | None]:
    content, reasoning, calls, finish = "", "", {}, None
    for chunk in chunks:
        for choice in chunk.choices:
            d = choice.delta
            content += d.content or ""
            reasoning += getattr(d, "reasoning", None) or (d.model_extra or {}).get("reasoning") or ""
            for tc in d.tool_calls or []:
                call = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
                if tc.id:
                    assert call["id"] is None, "id sent twice"
                    call["id"] = tc.id
                if tc.function and tc.function.name:
                    assert not call["name"], "name sent twice"
                    call["name"] = tc.function.name
                if tc.function and tc.function.arguments:
                    call["arguments"] += tc.function.arguments
            finish = choice.finish_reason or finish
    return content, reasoning, [calls[i] for i in sorted(calls)], finish


def test_auto_parallel_calls_stream_equals_non_stream(hermes):
    text = "</think>" + HERMES_TWO
    out = _chat(hermes, text)
    msg = out.choices[0].message
    assert out.choices[0].finish_reason == "tool_calls"
    assert msg.content == "Let me check."
    assert [c.function.name for c in msg.tool_calls] == ["get_weather", "get_time"]
    assert json.loads(msg.tool_calls[0].function.arguments) == {"city": "Paris", "days": 2}
    assert all(c.id.startswith("chatcmpl-tool-") for c in msg.tool_calls)
    content, _, calls, finish = _rebuild(_stream(hermes, text))
    assert finish == "tool_calls" and content == "Let me check."
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [
        (c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls]


def test_reasoning_split_and_counted(hermes):
    text = "I should look it up.</think>It is sunny."
    out = _chat(hermes, text)
    msg = out.choices[0].message
    assert msg.model_extra.get("reasoning") == "I should look it up."
    assert msg.content == "It is sunny."
    assert out.usage.completion_tokens_details.reasoning_tokens > 0
    content, reasoning, calls, finish = _rebuild(_stream(hermes, text))
    assert (content, reasoning, calls, finish) == ("It is sunny.", "I should look it up.", [], "stop")
