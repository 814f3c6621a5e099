"""Start-up checks as vLLM 0.32 makes them: parser names, the plugin flag, and the
tokenizer refusals (a parser that needs a special token the tokenizer lacks)."""

from __future__ import annotations

import textwrap

import pytest
from parser_replay import Request

from loramux.platform.openai.parsers import (
    ParserStartupError,
    ReasoningParserManager,
    ToolParser,
    ToolParserManager,
    load_parser_plugins,
    validate_parser_flags,
    validate_parser_tokenizer,
)

VLLM_TOOL_NAMES = {"hermes", "llama3_json", "pythonic", "mistral", "qwen3_xml"}
VLLM_REASONING_NAMES = {"deepseek_r1", "qwen3", "olmo3"}


class VocabOnly:
    """A tokenizer double with just a vocabulary (vLLM's tests use the same)."""

    def __init__(self, vocab: dict[str, int]) -> None:
        self._vocab = vocab

    def get_vocab(self) -> dict[str, int]:
        return dict(self._vocab)


def test_vllm_names_are_registered():
    assert VLLM_TOOL_NAMES <= set(ToolParserManager.list_registered())
    assert VLLM_REASONING_NAMES <= set(ReasoningParserManager.list_registered())


def test_unknown_name_lists_the_choices():
    with pytest.raises(KeyError, match="Available parsers: .*hermes"):
        ToolParserManager.get_tool_parser("nope")
    with pytest.raises(KeyError, match="Available parsers: .*deepseek_r1"):
        ReasoningParserManager.get_reasoning_parser("nope")


def test_flag_refusals():
    with pytest.raises(
        ParserStartupError, match="--enable-auto-tool-choice requires --tool-call-parser"
    ):
        validate_parser_flags(True, None, None)
    with pytest.raises(
        ParserStartupError, match=r"invalid tool call parser: nope \(chose from \{ .*hermes"
    ):
        validate_parser_flags(True, "nope", None)
    with pytest.raises(ParserStartupError, match=r"invalid reasoning parser: nope \(chose from"):
        validate_parser_flags(False, None, "nope")
    validate_parser_flags(True, "hermes", "qwen3")
    validate_parser_flags(False, None, None)


# (parser, tokens it needs as vocabulary entries, the refusal's words)
NEEDS_TOKENS = [
    ("llama3_json", ("<|python_tag|>",), "could not locate the bot token '<|python_tag|>'"),
    ("mistral", ("[TOOL_CALLS]",), "could not locate the tool call token"),
]
TEXT_MARKERS = ["hermes", "pythonic", "qwen3_xml"]


@pytest.mark.parametrize(("name", "tokens", "message"), NEEDS_TOKENS)
def test_tool_parser_refuses_a_tokenizer_without_its_token(name, tokens, message, make_tokenizer):
    parser_cls = ToolParserManager.get_tool_parser(name)
    with pytest.raises(RuntimeError, match=message):
        parser_cls(make_tokenizer())
    with pytest.raises(
        ParserStartupError,
        match=f"--tool-call-parser {name} cannot be used with the tokenizer of 'SmolLM2'",
    ):
        validate_parser_tokenizer(make_tokenizer(), tool_call_parser=name, model_name="SmolLM2")
    parser_cls(make_tokenizer(*tokens))  # accepted once the vocabulary has them
    validate_parser_tokenizer(make_tokenizer(*tokens), tool_call_parser=name)


@pytest.mark.parametrize("name", TEXT_MARKERS)
def test_tool_parser_matching_text_accepts_any_tokenizer(name, make_tokenizer):
    ToolParserManager.get_tool_parser(name)(make_tokenizer())
    ToolParserManager.get_tool_parser(name)(VocabOnly({"hello": 0}))
    validate_parser_tokenizer(make_tokenizer(), tool_call_parser=name)


def test_a_parser_needs_a_tokenizer():
    with pytest.raises(ValueError, match="tokenizer must be passed"):
        ToolParserManager.get_tool_parser("hermes")(None)


def test_deepseek_r1_refuses_a_tokenizer_without_think_tokens(make_tokenizer):
    parser_cls = ReasoningParserManager.get_reasoning_parser("deepseek_r1")
    with pytest.raises(RuntimeError, match="could not locate think start/end tokens"):
        parser_cls(make_tokenizer())
    with pytest.raises(RuntimeError, match="could not locate think start/end tokens"):
        parser_cls(make_tokenizer("<think>"))
    with pytest.raises(ParserStartupError, match="--reasoning-parser deepseek_r1 cannot be used"):
        validate_parser_tokenizer(make_tokenizer(), reasoning_parser="deepseek_r1")
    parser_cls(make_tokenizer("<think>", "</think>"))


def test_qwen3_matches_think_as_text_and_accepts_any_tokenizer(make_tokenizer):
    parser_cls = ReasoningParserManager.get_reasoning_parser("qwen3")
    parser_cls(make_tokenizer())
    parser_cls(VocabOnly({"hello": 0}))


def test_olmo3_needs_the_byte_level_pieces_of_its_markers(plain_tokenizer):
    parser_cls = ReasoningParserManager.get_reasoning_parser("olmo3")
    parser_cls(plain_tokenizer)  # SmolLM2's BPE has "</", "Ġ</", "think", ">"
    with pytest.raises(KeyError, match="not in the vocabulary"):
        parser_cls(VocabOnly({"</": 0, "think": 1, ">": 2}))
    with pytest.raises(ParserStartupError, match="--reasoning-parser olmo3 cannot be used"):
        validate_parser_tokenizer(VocabOnly({"hello": 0}), reasoning_parser="olmo3")


def test_both_refusals_are_named(plain_tokenizer):
    with pytest.raises(ParserStartupError) as caught:
        validate_parser_tokenizer(
            plain_tokenizer, tool_call_parser="mistral", reasoning_parser="deepseek_r1"
        )
    assert "--tool-call-parser mistral and --reasoning-parser deepseek_r1" in str(caught.value)


PLUGIN = '''
import json

from loramux.platform.openai.parsers import (
    ExtractedToolCalls, FunctionCall, ToolCall, ToolParser, ToolParserManager,
)


@ToolParserManager.register_module(["{name}", "{name}_alias"])
class CallLineParser(ToolParser):
    """CALL name {{json}} on one line."""

    def extract_tool_calls(self, model_output, request):
        if not model_output.startswith("CALL "):
            return ExtractedToolCalls(False, [], model_output)
        name, _, args = model_output[5:].partition(" ")
        json.loads(args)
        return ExtractedToolCalls(True, [ToolCall(FunctionCall(name, args))], None)

    def extract_tool_calls_streaming(self, previous_text, current_text, delta_text,
                                     previous_token_ids, current_token_ids,
                                     delta_token_ids, request):
        return None
'''


@pytest.fixture
def plugin_names():
    names: list[str] = []
    yield names
    for name in names:
        ToolParserManager._parsers.pop(name, None)
        ToolParserManager._lazy.pop(name, None)


def test_tool_parser_plugin_file_registers_a_parser(tmp_path, plugin_names, plain_tokenizer):
    plugin_names += ["call_line", "call_line_alias"]
    path = tmp_path / "call_line_plugin.py"
    path.write_text(textwrap.dedent(PLUGIN.format(name="call_line")))
    with pytest.raises(ParserStartupError, match="invalid tool call parser: call_line"):
        validate_parser_flags(True, "call_line", None)
    load_parser_plugins(tool_parser_plugin=str(path))
    validate_parser_flags(True, "call_line", None)
    validate_parser_flags(True, "call_line_alias", None)
    parser_cls = ToolParserManager.get_tool_parser("call_line")
    assert issubclass(parser_cls, ToolParser)
    parser = parser_cls(plain_tokenizer)
    result = parser.safe_extract_tool_calls('CALL get_weather {"city": "Tokyo"}', Request())
    assert result.tool_calls[0].function.name == "get_weather"
    # its bug is a parser failure, not a 500
    broken = parser.safe_extract_tool_calls("CALL f {not json", Request())
    assert broken.content == "CALL f {not json" and broken.parse_failed


def test_a_plugin_that_fails_to_load_is_refused_by_name(tmp_path, plugin_names):
    path = tmp_path / "broken_plugin.py"
    path.write_text("raise ImportError('boom')\n")
    load_parser_plugins(tool_parser_plugin=str(path))  # logged, as vLLM does
    with pytest.raises(ParserStartupError, match="invalid tool call parser: broken"):
        validate_parser_flags(True, "broken", None)


def test_register_module_refuses_a_taken_name_without_force(plugin_names):
    plugin_names.append("taken")

    class One(ToolParser):
        def extract_tool_calls(self, model_output, request):
            raise AssertionError

        def extract_tool_calls_streaming(self, *args):
            raise AssertionError

    ToolParserManager.register_module("taken", module=One)
    with pytest.raises(KeyError, match="already registered"):
        ToolParserManager.register_module("taken", force=False, module=One)
    with pytest.raises(TypeError, match="subclass of ToolParser"):
        ToolParserManager.register_module("taken", module=dict)
