"""``/v1/responses`` over the tiny engine with the official ``openai`` client: non-streamed
and streamed answers agree, ``previous_response_id`` continues the stored conversation (and
only the caller's), instructions are not inherited, ``text.format``, ``max_output_tokens``,
bad input items, retrieve and delete."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from support.platform_settings import ADMIN_KEY, BASE
from support.server import serve_in_thread

GREEDY = {"model": BASE, "temperature": 0, "max_output_tokens": 8}


@pytest.fixture
async def oai(app, env):
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test",
                             timeout=60)
    async with http:
        yield (openai.AsyncOpenAI(base_url="http://test/v1", api_key=env.key_a, http_client=http,
                                  max_retries=0),
               openai.AsyncOpenAI(base_url="http://test/v1", api_key=env.key_b, http_client=http,
                                  max_retries=0))


def _dump(response) -> dict:
    return response.model_dump(exclude_none=True)


def _counts(usage) -> dict:
    """A usage's token counts but the cached ones (a repeated prompt hits the prefix cache)."""
    out = _dump(usage)
    out.pop("input_tokens_details", None)
    return out


async def test_create_answers_in_the_response_shape(oai, client, env):
    a, _ = oai
    r = await a.responses.create(input="Hello there", instructions="Be brief.",
                                 metadata={"k": "v"}, **GREEDY)
    assert r.id.startswith("resp_") and r.object == "response" and r.model == BASE
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    (msg,) = r.output
    assert msg.type == "message" and msg.id.startswith("msg_") and msg.role == "assistant"
    assert msg.content[0].type == "output_text" and msg.content[0].annotations == []
    assert r.output_text == msg.content[0].text and r.output_text
    assert r.usage.output_tokens == 8 and r.usage.input_tokens > 0
    assert r.usage.total_tokens == r.usage.input_tokens + 8
    assert r.usage.input_tokens_details.cached_tokens >= 0
    assert r.usage.output_tokens_details.reasoning_tokens == 0
    assert (r.instructions, r.max_output_tokens, r.temperature) == ("Be brief.", 8, 0.0)
    assert r.store is True and r.metadata == {"k": "v"} and r.tools == []
    assert r.tool_choice == "auto" and r.parallel_tool_calls is True
    assert r.text.format.type == "text"
    got = await a.responses.retrieve(r.id)
    assert _dump(got) == _dump(r)
    raw = await client.post("/v1/responses", headers=env.headers(env.key_a),
                            json={"input": "hi", "frobnicate": 1, **GREEDY})
    assert raw.status_code == 200 and raw.headers["x-loramux-stored"] == "true"
    assert "frobnicate had no effect" in raw.headers["x-loramux-warnings"]
    assert "x-loramux-params" in raw.headers


async def test_streamed_equals_non_streamed(oai):
    a, _ = oai
    plain = await a.responses.create(input="Tell me a story", **GREEDY)
    events = [e async for e in await a.responses.create(input="Tell me a story", stream=True,
                                                        **GREEDY)]
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[2:4] == ["response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert deltas == final.output_text == plain.output_text
    assert _counts(final.usage) == _counts(plain.usage) and final.status == plain.status
    assert final.usage.input_tokens_details.cached_tokens > 0  # the same prompt again
    assert [o.type for o in final.output] == [o.type for o in plain.output]
    assert (await a.responses.retrieve(final.id)).output_text == plain.output_text


async def test_previous_response_id_continues_the_conversation(oai):
    a, _ = oai
    first = await a.responses.create(input="My name is Ada.", instructions="Secret rule.",
                                     **GREEDY)
    second = await a.responses.create(input="What is my name?", previous_response_id=first.id,
                                      **GREEDY)
    assert second.previous_response_id == first.id and second.instructions is None
    # the same conversation sent whole, without the first call's instructions
    whole = await a.responses.create(input=[
        {"role": "user", "content": "My name is Ada."},
        {"type": "message", "role": "assistant",
         "content": [{"type": "output_text", "text": first.output_text}]},
        {"role": "user", "content": [{"type": "input_text", "text": "What is my name?"}]},
    ], store=False, **GREEDY)
    assert second.usage.input_tokens == whole.usage.input_tokens
    assert second.output_text == whole.output_text
    # a third turn continues the second (the chain, not just one step)
    third = await a.responses.create(input="Again?", previous_response_id=second.id,
                                     **GREEDY)
    assert third.usage.input_tokens > second.usage.input_tokens + second.usage.output_tokens
    with pytest.raises(openai.NotFoundError) as e:  # store: false kept nothing
        await a.responses.retrieve(whole.id)
    assert e.value.status_code == 404


async def test_another_tenants_id_is_not_found(oai):
    a, b = oai
    mine = await a.responses.create(input="private", **GREEDY)
    for call in (lambda: b.responses.retrieve(mine.id), lambda: b.responses.delete(mine.id),
                 lambda: b.responses.create(input="x", previous_response_id=mine.id, **GREEDY),
                 lambda: a.responses.create(input="x", previous_response_id="resp_nope",
                                            **GREEDY)):
        with pytest.raises(openai.NotFoundError) as e:
            await call()
        assert e.value.body["code"] == "response_not_found"
    with pytest.raises(openai.NotFoundError) as e:
        await b.responses.create(input="x", previous_response_id=mine.id, **GREEDY)
    assert e.value.param == "previous_response_id"
    assert (await a.responses.retrieve(mine.id)).id == mine.id  # b's delete did nothing


async def test_delete_then_get_is_404(oai, client, env):
    a, _ = oai
    r = await a.responses.create(input="to delete", **GREEDY)
    raw = await client.delete(f"/v1/responses/{r.id}", headers=env.headers(env.key_a))
    assert raw.json() == {"id": r.id, "object": "response", "deleted": True}
    for call in (lambda: a.responses.retrieve(r.id), lambda: a.responses.delete(r.id),
                 lambda: a.responses.create(input="x", previous_response_id=r.id, **GREEDY)):
        with pytest.raises(openai.NotFoundError):
            await call()


async def test_json_schema_format_gives_valid_json(oai):
    """A schema with no room for whitespace (the random tiny model would fill any with it)."""
    a, _ = oai
    schema = {"type": "string", "enum": ["yes", "no"]}
    r = await a.responses.create(
        model=BASE, input="Answer in JSON.", temperature=0, max_output_tokens=40,
        text={"format": {"type": "json_schema", "name": "answer", "schema": schema,
                         "strict": True}})
    assert r.status == "completed", r.output_text
    assert json.loads(r.output_text) in ("yes", "no")
    assert r.text.format.type == "json_schema" and r.text.format.name == "answer"
    obj = await a.responses.create(model=BASE, input="JSON", text={"format": {
        "type": "json_object"}}, max_output_tokens=3, temperature=0)
    assert obj.output_text.startswith("{")


@pytest.mark.parametrize("body, param", [
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content[0].type"),
    ({"input": [{"type": "input_file", "file_id": "f"}]}, "input[0].type"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]},
     "input[0].call_id"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": "x", "tool_choice": {"type": "file_search"}}, "tool_choice"),
    ({"input": "x", "text": {"format": {"type": "xml"}}}, "text.format.type"),
    ({"input": []}, "input"),
    ({"input": "x " * 400}, "input"),
])
async def test_bad_requests_are_400_naming_the_field(client, env, body, param):
    r = await client.post("/v1/responses", headers=env.headers(env.key_a),
                          json={"model": BASE, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["param"] == param, err


async def test_anonymous_callers_store_nothing(env, tmp_path):
    from support.platform_settings import settings

    from loramux.platform.app import create_app
    from loramux.platform.state import close_state

    app = create_app(settings(allow_anonymous=True), engine=env.engine, registry=env.registry)
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://test", timeout=60) as c:
            r = await c.post("/v1/responses", json={"input": "hi", **GREEDY})
            assert r.status_code == 200 and r.json()["store"] is False
            assert r.headers.get("x-loramux-stored") is None
            assert "store had no effect" in r.headers["x-loramux-warnings"]
            r2 = await c.post("/v1/responses", json={"input": "hi", "previous_response_id":
                                                     r.json()["id"], **GREEDY})
            assert r2.status_code == 404 and r2.json()["error"]["param"] == "previous_response_id"
            assert (await c.get(f"/v1/responses/{r.json()['id']}")).status_code == 404
    finally:
        close_state(app.services)


def test_stream_helper_rebuilds_the_same_response_live(app, env):
    """The client's ``responses.stream()`` helper over a real uvicorn server (it needs
    ``response.completed``: a cut answer ends with ``response.incomplete``, as OpenAI's)."""
    done = {**GREEDY, "text": {"format": {"type": "json_schema", "name": "yn",
                                          "schema": {"enum": ["yes", "no"]}}}}
    with serve_in_thread(app) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=env.key_a, max_retries=0,
                               timeout=60)
        plain = client.responses.create(input="Once upon a time", **done)
        assert plain.status == "completed"
        with client.responses.stream(input="Once upon a time", **done) as stream:
            deltas = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
            final = stream.get_final_response()
        assert deltas == final.output_text == plain.output_text
        assert final.status == plain.status and _counts(final.usage) == _counts(plain.usage)
        stored = client.responses.retrieve(final.id)
        assert _dump(stored) == _dump(final)
        client.responses.delete(final.id)


async def test_tool_call_turns_continue_through_the_store(oai, client, env):
    """A function call and its output as input items, then continued by id: the stored
    conversation keeps the call and the tool message; the metrics say ``responses``."""
    a, _ = oai
    tool = {"type": "function", "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}
    first = await a.responses.create(input=[
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather",
         "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
    ], tools=[tool], tool_choice="none", **GREEDY)
    assert first.tools[0].name == "get_weather" and first.tool_choice == "none"
    stored = env.registry.get_stored_response(env.tenant_a.id, first.id)
    roles = [m["role"] for m in stored.conversation["messages"]]
    assert roles == ["user", "assistant", "tool", "assistant"]
    assert stored.conversation["messages"][1]["tool_calls"][0]["id"] == "call_1"
    second = await a.responses.create(input="And tomorrow?", previous_response_id=first.id,
                                      tools=[tool], tool_choice="none", **GREEDY)
    assert second.usage.input_tokens > first.usage.input_tokens
    r = await client.get("/metrics", headers={"Authorization": f"Bearer {ADMIN_KEY}"})
    assert 'endpoint="responses"' in r.text
