"""Every tool parser on texts in its model's documented format (most taken from vLLM's
own parser tests): the non-streamed calls and content, and the same calls rebuilt
from the stream, fed token by token and in character chunks."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest
from parser_replay import STREAM_MODES, Request, function_tool, stream_tool_parser

from loramux.platform.openai.parsers import ToolParserManager

WEATHER = '{"name": "get_weather", "arguments": {"city": "Tokyo", "unit": "celsius"}}'
TIME = '{"name": "get_time", "arguments": {"timezone": "Asia/Tokyo"}}'


@dataclass
class Case:
    id: str
    parser: str
    text: str
    calls: list[tuple[str, dict]]
    content: str | None
    streamed_content: str | None = None  # None: the same as content
    special_tokens: tuple[str, ...] = ()
    request: Request | None = None
    exact_arguments: bool = True  # streamed arguments equal the non-streamed as text


CASES = [
    # hermes (Hermes 2 Pro, Qwen2.5 / Qwen3 chat templates)
    Case("hermes-none", "hermes", "The weather in Tokyo is sunny.", [], "The weather in Tokyo is sunny."),
    Case(
        "hermes-single", "hermes", f"<tool_call>\n{WEATHER}\n</tool_call>",
        [("get_weather", {"city": "Tokyo", "unit": "celsius"})], None,
    ),
    Case(
        "hermes-special-tokens", "hermes", f"<tool_call>\n{WEATHER}\n</tool_call>",
        [("get_weather", {"city": "Tokyo", "unit": "celsius"})], None,
        special_tokens=("<tool_call>", "</tool_call>"),
    ),
    Case(
        "hermes-content-before", "hermes",
        f"Let me check that for you.\n<tool_call>\n{WEATHER}\n</tool_call>",
        [("get_weather", {"city": "Tokyo", "unit": "celsius"})], "Let me check that for you.\n",
    ),
    Case(
        "hermes-parallel", "hermes",
        f"<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>\n{TIME}\n</tool_call>",
        [("get_weather", {"city": "Tokyo", "unit": "celsius"}), ("get_time", {"timezone": "Asia/Tokyo"})],
        None, special_tokens=("<tool_call>", "</tool_call>"),
    ),
    Case(
        "hermes-unclosed-last", "hermes", f"<tool_call>\n{WEATHER}",
        [("get_weather", {"city": "Tokyo", "unit": "celsius"})], None,
    ),
    Case(
        "hermes-nested-unicode", "hermes",
        '<tool_call>\n{"name": "search", "arguments": {"q": "café 東京", "filters": {"tags": ["a", "b"], "n": 3}}}\n</tool_call>',
        [("search", {"q": "café 東京", "filters": {"tags": ["a", "b"], "n": 3}})], None,
    ),
    # llama3_json (Llama 3.1 / 3.2 JSON tool calling)
    Case(
        "llama-single", "llama3_json",
        '{"name": "get_weather", "parameters": {"city": "Tokyo", "unit": "celsius"}}',
        [("get_weather", {"city": "Tokyo", "unit": "celsius"})], None,
        special_tokens=("<|python_tag|>",),
    ),
    Case(
        "llama-python-tag", "llama3_json", f"<|python_tag|>{WEATHER}",
        [("get_weather", {"city": "Tokyo", "unit": "celsius"})], None,
        special_tokens=("<|python_tag|>",),
    ),
    Case(
        "llama-parallel", "llama3_json", f"{WEATHER}; {TIME}",
        [("get_weather", {"city": "Tokyo", "unit": "celsius"}), ("get_time", {"timezone": "Asia/Tokyo"})],
        None, special_tokens=("<|python_tag|>",),
    ),
    Case(
        "llama-none", "llama3_json", "Tokyo is sunny today.", [], "Tokyo is sunny today.",
        special_tokens=("<|python_tag|>",),
    ),
    # pythonic (Llama 3.2 / 4, ToolACE)
    Case(
        "pythonic-single", "pythonic", "[get_weather(city='San Francisco', metric='celsius')]",
        [("get_weather", {"city": "San Francisco", "metric": "celsius"})], None,
    ),
    Case(
        "pythonic-parallel", "pythonic",
        "[get_weather(city='San Francisco', metric='celsius'), "
        "register_user(name='John Doe', age=37, address={'city': 'San Francisco', 'state': 'CA'}, "
        "role=None, passed_test=True, aliases=['John', 'Johnny'])]",
        [
            ("get_weather", {"city": "San Francisco", "metric": "celsius"}),
            ("register_user", {
                "name": "John Doe", "age": 37, "address": {"city": "San Francisco", "state": "CA"},
                "role": None, "passed_test": True, "aliases": ["John", "Johnny"],
            }),
        ],
        None,
    ),
    Case("pythonic-no-args", "pythonic", "[do_something_cool()]", [("do_something_cool", {})], None),
    Case(
        "pythonic-json-literals", "pythonic", "[set_mode(on=true, level=-2, note=null)]",
        [("set_mode", {"on": True, "level": -2, "note": None})], None,
    ),
    Case("pythonic-none", "pythonic", "Hello! How can I help?", [], "Hello! How can I help?"),
    # mistral, pre-v11 tokenizer ([TOOL_CALLS] + JSON array)
    Case(
        "mistral-pre-v11", "mistral",
        '[TOOL_CALLS][{"name": "add", "arguments": {"a": 3.5, "b": 4}}]',
        [("add", {"a": 3.5, "b": 4})], None, special_tokens=("[TOOL_CALLS]",),
    ),
    Case(
        "mistral-pre-v11-parallel-content", "mistral",
        'Sure. [TOOL_CALLS][{"name": "add", "arguments": {"a": 1, "b": 2}}, '
        '{"name": "get_time", "arguments": {"timezone": "UTC"}}]',
        [("add", {"a": 1, "b": 2}), ("get_time", {"timezone": "UTC"})], "Sure. ",
        special_tokens=("[TOOL_CALLS]",),
    ),
    Case(
        "mistral-pre-v11-compact", "mistral",
        '[TOOL_CALLS][{"name":"add","arguments":{"a":1,"b":2}}]',
        [("add", {"a": 1, "b": 2})], None, special_tokens=("[TOOL_CALLS]",),
        exact_arguments=False,  # vLLM streams the raw text, returns json.dumps of it
    ),
    Case(
        "mistral-pre-v11-spaced", "mistral",
        '[TOOL_CALLS]  [ {"name":"add" , "arguments" : {"a": 3, "b": 4} } ]',
        [("add", {"a": 3, "b": 4})], None, special_tokens=("[TOOL_CALLS]",),
    ),
    Case(
        "mistral-pre-v11-arguments-before-name", "mistral",
        '[TOOL_CALLS] [{"arguments": {"name": "John Doe"}, "name": "get_age"}]',
        [("get_age", {"name": "John Doe"})], None, special_tokens=("[TOOL_CALLS]",),
    ),
    Case(
        "mistral-pre-v11-trailing-text", "mistral",
        '[TOOL_CALLS] [{"name": "get_current_weather", "arguments": {"city": "Dallas", '
        '"state": "TX", "unit": "fahrenheit"}}]\nextra trailing data',
        [("get_current_weather", {"city": "Dallas", "state": "TX", "unit": "fahrenheit"})],
        None, streamed_content="\nextra trailing data", special_tokens=("[TOOL_CALLS]",),
    ),
    # mistral, v11+ tokenizer ([TOOL_CALLS]name[ARGS]{...})
    Case(
        "mistral-v11", "mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Tokyo", "unit": "celsius"}',
        [("get_weather", {"city": "Tokyo", "unit": "celsius"})], None,
        special_tokens=("[TOOL_CALLS]", "[ARGS]"),
    ),
    Case(
        "mistral-v11-parallel", "mistral",
        'Checking. [TOOL_CALLS]get_weather[ARGS]{"city": "Tokyo"}[TOOL_CALLS]get_time[ARGS]{"timezone": "UTC"}',
        [("get_weather", {"city": "Tokyo"}), ("get_time", {"timezone": "UTC"})], "Checking.",
        streamed_content="Checking. ", special_tokens=("[TOOL_CALLS]", "[ARGS]"),
    ),
    Case(
        "mistral-v11-name-brace", "mistral", '[TOOL_CALLS]get_weather{"city": "Tokyo"}',
        [("get_weather", {"city": "Tokyo"})], None, special_tokens=("[TOOL_CALLS]", "[ARGS]"),
    ),
    Case(
        "mistral-v11-content-with-brace", "mistral",
        'hi{hi[TOOL_CALLS]bash{"command": "print(\\"hello world!\\")\\nre.compile(r\'{}\')"}',
        [("bash", {"command": "print(\"hello world!\")\nre.compile(r'{}')"})], "hi{hi",
        special_tokens=("[TOOL_CALLS]", "[ARGS]"),
    ),
    Case(
        "mistral-none", "mistral", "No tools needed.", [], "No tools needed.",
        special_tokens=("[TOOL_CALLS]", "[ARGS]"),
    ),
    # qwen3_xml (Qwen3-Coder)
    Case(
        "qwen3-single", "qwen3_xml",
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nTokyo\n</parameter>\n</function>\n</tool_call>",
        [("get_weather", {"city": "Tokyo"})], None,
    ),
    Case(
        "qwen3-parallel", "qwen3_xml",
        "<tool_call>\n<function=get_weather>\n<parameter=city>Tokyo</parameter>\n</function>\n</tool_call>"
        "<tool_call>\n<function=get_time>\n<parameter=timezone>Asia/Tokyo</parameter>\n</function>\n</tool_call>",
        [("get_weather", {"city": "Tokyo"}), ("get_time", {"timezone": "Asia/Tokyo"})], None,
        special_tokens=("<tool_call>", "</tool_call>"),
    ),
    Case(
        "qwen3-surrounding-text", "qwen3_xml",
        "Let me check the weather for you.\n\n<tool_call>\n<function=get_weather>\n"
        "<parameter=city>Tokyo</parameter>\n</function>\n</tool_call>\n\nI will get that information.",
        [("get_weather", {"city": "Tokyo"})], "Let me check the weather for you.",
        streamed_content="Let me check the weather for you.\n\n\n\nI will get that information.",
    ),
    Case(
        "qwen3-escaped-strings", "qwen3_xml",
        "<tool_call>\n<function=test_function>\n<parameter=quoted>He said \"hello\"</parameter>\n"
        "<parameter=path>C:\\Users\\file.txt</parameter>\n<parameter=newline>line1\nline2</parameter>\n"
        "</function>\n</tool_call>",
        [("test_function", {"quoted": 'He said "hello"', "path": "C:\\Users\\file.txt", "newline": "line1\nline2"})],
        None,
    ),
    Case(
        "qwen3-empty-arguments", "qwen3_xml",
        "<tool_call>\n<function=refresh>\n</function>\n</tool_call>", [("refresh", {})], None,
    ),
    Case(
        "qwen3-typed-by-schema", "qwen3_xml",
        "<tool_call>\n<function=test_function>\n<parameter=string_field>hello</parameter>\n"
        "<parameter=int_field>42</parameter>\n<parameter=float_field>3.14</parameter>\n"
        "<parameter=bool_field>true</parameter>\n<parameter=null_field>null</parameter>\n"
        '<parameter=array_field>["a", "b", "c"]</parameter>\n'
        '<parameter=object_field>{"nested": "value"}</parameter>\n</function>\n</tool_call>',
        [("test_function", {
            "string_field": "hello", "int_field": 42, "float_field": 3.14, "bool_field": True,
            "null_field": None, "array_field": ["a", "b", "c"], "object_field": {"nested": "value"},
        })],
        None,
        request=Request(tools=[function_tool("test_function", {
            "string_field": {"type": "string"}, "int_field": {"type": "integer"},
            "float_field": {"type": "number"}, "bool_field": {"type": "boolean"},
            "null_field": {"type": ["string", "null"]}, "array_field": {"type": "array"},
            "object_field": {"type": "object"},
        })]),
    ),
    Case(
        "qwen3-untyped-without-schema", "qwen3_xml",
        "<tool_call>\n<function=f>\n<parameter=n>42</parameter>\n<parameter=b>true</parameter>\n</function>\n</tool_call>",
        [("f", {"n": "42", "b": "true"})], None,
    ),
]  # fmt: skip


def _parser(case: Case, make_tokenizer):
    tokenizer = make_tokenizer(*case.special_tokens)
    parser_cls = ToolParserManager.get_tool_parser(case.parser)
    return parser_cls(tokenizer), tokenizer


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_non_streamed(case: Case, make_tokenizer):
    parser, _ = _parser(case, make_tokenizer)
    result = parser.safe_extract_tool_calls(case.text, case.request or Request())
    assert result.tools_called == bool(case.calls)
    assert [
        (c.function.name, json.loads(c.function.arguments)) for c in result.tool_calls
    ] == case.calls
    assert result.content == case.content
    assert not result.parse_failed
    ids = [c.id for c in result.tool_calls]
    assert len(set(ids)) == len(ids)
    for call in result.tool_calls:
        assert call.type == "function"
        if case.parser == "mistral":
            assert call.id.isalnum() and len(call.id) == 9
        else:
            assert (
                call.id.startswith("chatcmpl-tool-") and len(call.id) == len("chatcmpl-tool-") + 16
            )


@pytest.mark.parametrize("mode", STREAM_MODES)
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_streamed_rebuilds_the_non_streamed_calls(case: Case, mode: str, make_tokenizer):
    request = case.request or Request()
    parser, tokenizer = _parser(case, make_tokenizer)
    expected = parser.safe_extract_tool_calls(case.text, request)
    streamer, _ = _parser(case, make_tokenizer)
    replay = stream_tool_parser(streamer, tokenizer, case.text, request, mode)
    assert not streamer.parse_failed
    calls = [replay.calls[i] for i in sorted(replay.calls)]
    assert [c.name for c in calls] == [c.function.name for c in expected.tool_calls]
    for streamed, whole in zip(calls, expected.tool_calls, strict=True):
        assert json.loads(streamed.arguments) == json.loads(whole.function.arguments)
        if case.exact_arguments:
            assert streamed.arguments == whole.function.arguments
    streamed_content = case.content if case.streamed_content is None else case.streamed_content
    assert (replay.content or None) == streamed_content
