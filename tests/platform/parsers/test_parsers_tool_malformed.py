"""Text that looks like a call but does not parse: served as content, flagged as a
parser failure, never an exception (non-streamed or streamed)."""

from __future__ import annotations

import pytest
from parser_replay import STREAM_MODES, Request, stream_tool_parser

from loramux.platform.openai.parsers import ToolParserManager

MALFORMED = [
    # (parser, special tokens, text, expected content)
    ("hermes", (), '<tool_call>\n{"name": "get_weather", "arguments": {"city": </tool_call>', None),
    ("hermes", (), '<tool_call>{"name": "get_weather"}</tool_call>', None),  # no arguments
    ("hermes", (), "Sure <tool_call>not json at all</tool_call> done", None),
    (
        "llama3_json",
        ("<|python_tag|>",),
        '{"name": "get_weather", "arguments": {"city": "Tok',
        None,
    ),
    ("llama3_json", ("<|python_tag|>",), '{"arguments": {"city": "Tokyo"}}', None),  # no name
    ("pythonic", (), "[get_weather(city=Tokyo Japan)]", None),
    ("pythonic", (), "[get_weather(city=open('/etc/passwd'))]", None),  # not a literal
    ("mistral", ("[TOOL_CALLS]",), "[TOOL_CALLS] not json", "not json"),
    ("mistral", ("[TOOL_CALLS]",), '[TOOL_CALLS][{"other": 1}]', '[{"other": 1}]'),
    ("qwen3_xml", (), "<tool_call><function=></function></tool_call>", ""),
    ("qwen3_xml", (), "Let me see.<tool_call>\nnothing here\n</tool_call>", "Let me see."),
]


@pytest.mark.parametrize(("name", "tokens", "text", "content"), MALFORMED)
def test_non_streamed_is_content_and_flagged(name, tokens, text, content, make_tokenizer):
    parser = ToolParserManager.get_tool_parser(name)(make_tokenizer(*tokens))
    result = parser.safe_extract_tool_calls(text, Request())
    assert not result.tools_called and result.tool_calls == []
    assert result.parse_failed and parser.parse_failed
    # vLLM serves the whole text, except where its parser keeps only a part
    assert result.content == (text if content is None else content or None)


@pytest.mark.parametrize("mode", STREAM_MODES)
@pytest.mark.parametrize(("name", "tokens", "text", "content"), MALFORMED)
def test_streamed_never_raises(name, tokens, text, content, mode, make_tokenizer):
    tokenizer = make_tokenizer(*tokens)
    parser = ToolParserManager.get_tool_parser(name)(tokenizer)
    replay = stream_tool_parser(parser, tokenizer, text, Request(), mode)
    for call in replay.calls.values():
        assert call.name is not None
    assert parser.parse_failed  # counted like the non-streamed failure


def test_mistral_v11_call_with_broken_arguments_is_kept_and_flagged(make_tokenizer):
    """vLLM returns a v11 call whose arguments are not JSON as a call; it is flagged."""
    parser = ToolParserManager.get_tool_parser("mistral")(make_tokenizer("[TOOL_CALLS]", "[ARGS]"))
    result = parser.safe_extract_tool_calls('[TOOL_CALLS]get_weather[ARGS]{"city": ', Request())
    assert result.tools_called and result.tool_calls[0].function.name == "get_weather"
    assert result.tool_calls[0].function.arguments == '{"city":'
    assert result.parse_failed


def test_mistral_v11_marker_alone_is_no_call(make_tokenizer):
    parser = ToolParserManager.get_tool_parser("mistral")(make_tokenizer("[TOOL_CALLS]", "[ARGS]"))
    result = parser.safe_extract_tool_calls("Hello [TOOL_CALLS]", Request())
    assert not result.tools_called and result.content == "Hello "
    assert result.parse_failed


def test_mistral_pre_v11_finds_the_call_array_after_junk(make_tokenizer):
    parser = ToolParserManager.get_tool_parser("mistral")(make_tokenizer("[TOOL_CALLS]"))
    text = '[TOOL_CALLS]  junk [{"name": "add", "arguments":{"a": 1, "b": 2}}] trail'
    result = parser.safe_extract_tool_calls(text, Request())
    assert [(c.function.name, c.function.arguments) for c in result.tool_calls] == [
        ("add", '{"a": 1, "b": 2}')
    ]


def test_mistral_v11_name_without_arguments_is_a_call(make_tokenizer):
    parser = ToolParserManager.get_tool_parser("mistral")(make_tokenizer("[TOOL_CALLS]", "[ARGS]"))
    result = parser.safe_extract_tool_calls("[TOOL_CALLS]toolname_no_args", Request())
    assert [(c.function.name, c.function.arguments) for c in result.tool_calls] == [
        ("toolname_no_args", "{}")
    ]


def test_mistral_pre_v11_tool_choice_none_leaves_text(make_tokenizer):
    parser = ToolParserManager.get_tool_parser("mistral")(make_tokenizer("[TOOL_CALLS]"))
    text = '[TOOL_CALLS][{"name": "add", "arguments": {"a": 1}}]'
    request = Request(tools=[{"type": "function", "function": {"name": "add"}}], tool_choice="none")
    result = parser.safe_extract_tool_calls(text, request)
    assert not result.tools_called and result.content == text and not result.parse_failed


def test_mistral_pre_v11_forced_call_without_marker(make_tokenizer):
    """``tool_choice="required"`` guides a bare JSON array: parsed without [TOOL_CALLS]."""
    tokenizer = make_tokenizer("[TOOL_CALLS]")
    text = '[{"name": "add", "arguments": {"a": 1, "b": 2}}]'
    request = Request(tool_choice="required")
    parser = ToolParserManager.get_tool_parser("mistral")(tokenizer)
    result = parser.safe_extract_tool_calls(text, request)
    assert [c.function.name for c in result.tool_calls] == ["add"]
    replay = stream_tool_parser(
        ToolParserManager.get_tool_parser("mistral")(tokenizer), tokenizer, text, request
    )
    assert replay.calls[0].name == "add" and replay.calls[0].arguments == '{"a": 1, "b": 2}'


def test_hermes_drops_text_between_and_after_calls_like_vllm(plain_tokenizer):
    parser = ToolParserManager.get_tool_parser("hermes")(plain_tokenizer)
    text = (
        'A<tool_call>{"name": "f", "arguments": {}}</tool_call> B '
        '<tool_call>{"name": "g", "arguments": {"x": 1}}</tool_call> C'
    )
    result = parser.safe_extract_tool_calls(text, Request())
    assert [c.function.name for c in result.tool_calls] == ["f", "g"]
    assert result.content == "A"


def test_llama3_json_drops_surrounding_text_like_vllm(make_tokenizer):
    parser = ToolParserManager.get_tool_parser("llama3_json")(make_tokenizer("<|python_tag|>"))
    result = parser.safe_extract_tool_calls(
        'Here you go: {"name": "f", "arguments": {"a": 1}} thanks', Request()
    )
    assert result.tools_called and result.content is None


def test_llama3_json_braces_that_are_not_json_are_content(make_tokenizer):
    parser = ToolParserManager.get_tool_parser("llama3_json")(make_tokenizer("<|python_tag|>"))
    result = parser.safe_extract_tool_calls("use {x} here", Request())
    assert not result.tools_called and result.content == "use {x} here"


def test_a_parser_exception_is_served_as_content(plain_tokenizer):
    """Even a parser bug never escapes the safe entry points."""
    parser = ToolParserManager.get_tool_parser("hermes")(plain_tokenizer)

    def broken(*args, **kwargs):
        raise RuntimeError("bug")

    parser.extract_tool_calls = broken
    parser.extract_tool_calls_streaming = broken
    parser.finish_streaming = broken
    result = parser.safe_extract_tool_calls("<tool_call>{}</tool_call>", Request())
    assert result.content == "<tool_call>{}</tool_call>" and result.parse_failed
    assert parser.safe_extract_tool_calls_streaming("", "x", "x", [], [], [], Request()) is None
    assert parser.safe_finish_streaming() is None
    assert parser.parse_failed


@pytest.mark.parametrize(
    ("name", "tokens", "text", "content"),
    [
        (
            "qwen3_xml", (),
            "Sure.<tool_call>\n<function=f>\n<parameter=a>1</parameter>\n</function>\n</tool_call> Done.",
            "Sure. Done.",
        ),
        ("mistral", ("[TOOL_CALLS]", "[ARGS]"), 'Sure. [TOOL_CALLS]f[ARGS]{"a": 1}', "Sure. "),
    ],
)  # fmt: skip
def test_engine_parsers_return_no_calls_for_tool_choice_none(
    name, tokens, text, content, make_tokenizer
):
    """vLLM's engine-based parsers keep only the text outside calls then."""
    tokenizer = make_tokenizer(*tokens)
    request = Request(tools=[{"type": "function", "function": {"name": "f"}}], tool_choice="none")
    parser_cls = ToolParserManager.get_tool_parser(name)
    result = parser_cls(tokenizer).safe_extract_tool_calls(text, request)
    assert not result.tools_called and result.content == content
    replay = stream_tool_parser(parser_cls(tokenizer), tokenizer, text, request)
    assert replay.calls == {} and replay.content == content
