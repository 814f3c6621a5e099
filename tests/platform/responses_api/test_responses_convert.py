"""The converters on synthetic chat bodies and chunks (no engine): Responses input → chat
messages, tools, ``text.format``; a chat body with a thought and tool calls → output items;
streamed chunks → events that the ``openai`` client's own accumulator rebuilds into the
same response."""

from __future__ import annotations

import json

import pytest
from openai import omit
from openai._models import construct_type
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.responses import ResponseStreamEvent

from loramux.platform.errors import BadRequest
from loramux.platform.openai.responses_api import convert
from loramux.platform.openai.responses_api.events import ResponseEvents, sse_event
from loramux.platform.openai.responses_api.protocol import ResponsesRequest

CALL = {"type": "function_call", "call_id": "call_1", "name": "get_weather",
        "arguments": '{"city": "Paris"}'}
TOOL = {"type": "function", "name": "get_weather", "description": "Weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        "strict": True}


def _req(**kw) -> ResponsesRequest:
    return ResponsesRequest(**{"model": "m", "input": "hi", **kw})


def test_input_items_become_chat_messages():
    messages = convert.input_messages([
        {"role": "developer", "content": "Rules."},
        {"role": "user", "content": [{"type": "input_text", "text": "Weather "},
                                     {"type": "input_text", "text": "in Paris?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "message", "role": "assistant",
         "content": [{"type": "output_text", "text": "Let me look."}]},
        CALL, {**CALL, "call_id": "call_2", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "call_2",
         "output": [{"type": "input_text", "text": "rainy"}]},
    ])
    assert messages == [
        {"role": "system", "content": "Rules."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Let me look.", "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "call_2", "type": "function",
             "function": {"name": "get_weather", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call_2", "content": "rainy"},
    ]
    lone = convert.input_messages([{"role": "user", "content": "q"}, CALL])
    assert lone[1] == {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}


def test_to_chat_maps_every_field_and_warns_about_unknown_ones():
    req = _req(input=[{"role": "user", "content": "now"}], instructions="Be brief.",
               max_output_tokens=7, temperature=0.5, top_p=0.9, tools=[TOOL],
               tool_choice={"type": "function", "name": "get_weather"},
               parallel_tool_calls=False, user="u1", stream=True, truncation="auto",
               text={"format": {"type": "json_schema", "name": "w", "strict": True,
                                "schema": {"type": "object"}}})
    plan = convert.to_chat(req, [{"role": "user", "content": "before"},
                                 {"role": "assistant", "content": "ok"}])
    chat = plan.chat
    assert [(m.role, m.content) for m in chat.messages] == [
        ("system", "Be brief."), ("user", "before"), ("assistant", "ok"), ("user", "now")]
    assert plan.conversation == [{"role": "user", "content": "before"},
                                 {"role": "assistant", "content": "ok"},
                                 {"role": "user", "content": "now"}]  # no instructions
    assert (chat.max_tokens, chat.temperature, chat.top_p, chat.user) == (7, 0.5, 0.9, "u1")
    assert chat.stream and chat.stream_options.include_usage
    tools = [t if isinstance(t, dict) else t.model_dump(exclude_none=True) for t in chat.tools]
    assert tools == [{"type": "function", "function": {
        "name": "get_weather", "description": "Weather of a city",
        "parameters": TOOL["parameters"], "strict": True}}]
    assert chat.tool_choice == {"type": "function", "function": {"name": "get_weather"}}
    assert chat.response_format == {"type": "json_schema", "json_schema": {
        "name": "w", "strict": True, "schema": {"type": "object"}}}
    dumped = chat.model_dump()
    assert dumped.get("parallel_tool_calls") is False
    assert plan.tools == [TOOL]
    assert plan.warnings == ["truncation had no effect: it is not a recognized parameter"]
    plain = convert.to_chat(_req(), []).chat
    assert not plain.stream and plain.stream_options is None and plain.max_tokens is None
    assert convert.to_chat(_req(text={"format": {"type": "json_object"}}), []).chat \
        .response_format == {"type": "json_object"}


@pytest.mark.parametrize("kw, param", [
    ({"input": [{"role": "user", "content": [{"type": "input_audio"}]}]},
     "input[0].content[0].type"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
    ({"input": ["text"]}, "input[0]"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
    ({"tools": [{"type": "function"}]}, "tools[0].name"),
    ({"tools": [{"type": "function", "name": "f", "parameters": "x"}]}, "tools[0].parameters"),
    ({"tools": [{"type": "file_search"}]}, "tools[0].type"),
    ({"tool_choice": "sometimes"}, "tool_choice"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
])
def test_refusals_name_the_field(kw, param):
    with pytest.raises(BadRequest) as e:
        convert.to_chat(_req(**kw), [])
    assert e.value.param == param and e.value.status_code == 400


def _chat_body(message: dict, finish: str, reasoning_tokens: int = 0) -> dict:
    return {"id": "chatcmpl-1", "object": "chat.completion", "choices": [
        {"index": 0, "message": {"role": "assistant", **message}, "finish_reason": finish}],
        "usage": {"prompt_tokens": 10, "completion_tokens": 6, "total_tokens": 16,
                  "completion_tokens_details": {"reasoning_tokens": reasoning_tokens}}}


def _head() -> dict:
    return convert.response_head(_req(tools=[TOOL]), convert.to_chat(_req(tools=[TOOL]), []),
                                 {"temperature": 1.0}, store=True)


def test_a_chat_body_with_thought_and_calls_becomes_output_items():
    calls = [{"id": "call_a", "type": "function",
              "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
             {"id": "call_b", "type": "function",
              "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]
    r = convert.from_chat_body(_head(), _chat_body(
        {"content": None, "reasoning": "I should call the tool.", "tool_calls": calls},
        "tool_calls", reasoning_tokens=4))
    assert r["status"] == "completed" and r["incomplete_details"] is None
    assert [o["type"] for o in r["output"]] == ["reasoning", "function_call", "function_call"]
    rs, fa, fb = r["output"]
    assert rs["id"].startswith("rs_") and rs["summary"] == []
    assert rs["content"] == [{"type": "reasoning_text", "text": "I should call the tool."}]
    assert fa["id"].startswith("fc_") and fa["call_id"] == "call_a" and fa["status"] == "completed"
    assert (fb["name"], fb["arguments"]) == ("get_weather", '{"city": "Rome"}')
    assert r["usage"] == {"input_tokens": 10, "input_tokens_details": {"cached_tokens": 0},
                          "output_tokens": 6, "output_tokens_details": {"reasoning_tokens": 4},
                          "total_tokens": 16}
    assert r["tools"] == [TOOL] and r["temperature"] == 1.0
    # the stored conversation continues with the calls, without the thought
    assert convert.output_messages(r["output"]) == [
        {"role": "assistant", "content": "", "tool_calls": calls}]
    cut = convert.from_chat_body(_head(), _chat_body({"content": "abc"}, "length"))
    assert cut["status"] == "incomplete"
    assert cut["incomplete_details"] == {"reason": "max_output_tokens"}
    assert cut["output"][0]["status"] == "incomplete"
    assert cut["output"][0]["content"] == [{"type": "output_text", "text": "abc",
                                            "annotations": []}]


def _chunk(delta: dict | None = None, finish: str | None = None, usage: dict | None = None):
    choices = [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish}]
    return {"id": "chatcmpl-1", "object": "chat.completion.chunk", "choices": choices,
            "usage": usage}


CHUNKS = [
    _chunk({"role": "assistant", "content": ""}),
    _chunk({"reasoning": "Think"}), _chunk({"reasoning": "ing."}),
    _chunk({"content": "Calling."}),
    _chunk({"tool_calls": [{"index": 0, "id": "call_a", "type": "function",
                            "function": {"name": "get_weather", "arguments": ""}}]}),
    _chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"city": '}}]}),
    _chunk({"tool_calls": [{"index": 0, "function": {"arguments": '"Paris"}'}}]}),
    _chunk({"tool_calls": [{"index": 1, "id": "call_b", "type": "function",
                            "function": {"name": "noop", "arguments": "{}"}}]}),
    _chunk({}, "tool_calls"),
    _chunk(usage={"prompt_tokens": 5, "completion_tokens": 9, "total_tokens": 14,
                  "completion_tokens_details": {"reasoning_tokens": 2}}),
]


def _client_rebuild(events: list[dict]):
    """The ``openai`` client's ``responses.stream()`` accumulator fed our events (after a
    JSON round trip, as they travel)."""
    state = ResponseStreamState(input_tools=omit, text_format=omit)
    for e in events:
        event = json.loads(sse_event(e).split("data: ", 1)[1])
        state.handle_event(construct_type(type_=ResponseStreamEvent, value=event))
    return state._completed_response


def test_chunks_become_the_documented_event_sequence():
    events = ResponseEvents(_head())
    out = events.start()
    for c in CHUNKS:
        out += events.chunk(c)
    out += events.finish()
    kinds = [e["type"] for e in out]
    assert kinds == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added",
        "response.reasoning_text.delta", "response.reasoning_text.delta",
        "response.reasoning_text.done", "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.completed"]
    assert [e["sequence_number"] for e in out] == list(range(len(out)))
    assert out[0]["response"]["status"] == "in_progress" and out[0]["response"]["output"] == []
    final = out[-1]["response"]
    assert [o["type"] for o in final["output"]] == ["reasoning", "message", "function_call",
                                                   "function_call"]
    assert final["output"][2]["arguments"] == '{"city": "Paris"}'
    assert final["output"][2]["call_id"] == "call_a" and final["output"][3]["name"] == "noop"
    assert final["usage"]["output_tokens_details"] == {"reasoning_tokens": 2}
    assert all(o["status"] == "completed" for o in final["output"])
    # the same chat answer, not streamed, gives the same output (but for the item ids)
    body = convert.from_chat_body(_head(), _chat_body({
        "content": "Calling.", "reasoning": "Thinking.", "tool_calls": [
            {"id": "call_a", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "call_b", "type": "function", "function": {"name": "noop",
                                                              "arguments": "{}"}}]},
        "tool_calls"))

    def strip(items):
        return [{k: v for k, v in o.items() if k != "id"} for o in items]

    assert strip(final["output"]) == strip(body["output"])
    rebuilt = _client_rebuild(out)
    assert rebuilt.id == final["id"] and rebuilt.output_text == "Calling."
    assert [o.type for o in rebuilt.output] == ["reasoning", "message", "function_call",
                                                "function_call"]
    assert rebuilt.output[2].arguments == '{"city": "Paris"}'


def test_an_empty_answer_is_an_empty_message_and_a_cut_one_incomplete():
    events = ResponseEvents(_head())
    out = events.start() + events.chunk(_chunk({"role": "assistant", "content": ""}, "stop"))
    out += events.finish()
    assert out[-1]["type"] == "response.completed"
    assert out[-1]["response"]["output"][0]["content"][0]["text"] == ""
    assert _client_rebuild(out).output_text == ""
    events = ResponseEvents(_head())
    out = events.start() + events.chunk(_chunk({"content": "ab"}, "length")) + events.finish()
    assert out[-1]["type"] == "response.incomplete"
    assert out[-1]["response"]["output"][0]["status"] == "incomplete"


def test_an_error_mid_stream_fails_the_response():
    events = ResponseEvents(_head())
    out = events.start() + events.chunk(_chunk({"content": "partial"}))
    out += events.fail({"message": "the engine failed on this request", "type": "server_error",
                        "code": "engine_error", "param": None})
    assert [e["type"] for e in out[-2:]] == ["error", "response.failed"]
    assert out[-2]["code"] == "engine_error" and out[-2]["message"].startswith("the engine")
    failed = out[-1]["response"]
    assert failed["status"] == "failed" and failed["error"]["code"] == "engine_error"
    assert [e["sequence_number"] for e in out] == list(range(len(out)))
    assert sse_event(out[-1]).startswith("event: response.failed\ndata: {")
