"""The reasoning parsers on their models' formats: the non-streamed split, the same
split rebuilt from the stream, and the token-id queries the structured-output
backend uses."""

from __future__ import annotations

import pytest
from parser_replay import STREAM_MODES, Request, stream_reasoning_parser

from loramux.platform.openai.parsers import ReasoningParserManager, ToolParserManager

THINK_TOKENS = ("<think>", "</think>")

# (text, reasoning, content): DeepSeek-R1 (its template opens <think> in the prompt)
DEEPSEEK_R1 = [
    ("<think>This is a reasoning section</think>This is the rest", "This is a reasoning section", "This is the rest"),
    ("This is a reasoning section</think>This is the rest", "This is a reasoning section", "This is the rest"),
    ("<think>This is a reasoning section</think>", "This is a reasoning section", None),
    ("This is a reasoning section", "This is a reasoning section", None),
    ("<think>Step 1\nStep 2</think>\n\nThe answer is 4.", "Step 1\nStep 2", "\n\nThe answer is 4."),
]  # fmt: skip


def _split(replay) -> tuple[str | None, str | None]:
    return replay.reasoning or None, replay.content or None


@pytest.mark.parametrize(("text", "reasoning", "content"), DEEPSEEK_R1)
def test_deepseek_r1(text, reasoning, content, make_tokenizer):
    tokenizer = make_tokenizer(*THINK_TOKENS)
    parser_cls = ReasoningParserManager.get_reasoning_parser("deepseek_r1")
    assert parser_cls(tokenizer).extract_reasoning(text, Request()) == (reasoning, content)
    # streamed by token ids: the think tokens arrive whole, as from a real model
    assert _split(stream_reasoning_parser(parser_cls(tokenizer), tokenizer, text)) == (
        reasoning,
        content,
    )


def test_deepseek_r1_token_queries(make_tokenizer):
    tokenizer = make_tokenizer(*THINK_TOKENS)
    parser = ReasoningParserManager.get_reasoning_parser("deepseek_r1")(tokenizer)
    ids = tokenizer.encode("<think>a b c</think>the answer", add_special_tokens=False)
    start, end = parser.start_token_id, parser.end_token_id
    cut = ids.index(end)
    assert not parser.is_reasoning_end(ids[:cut])
    assert parser.is_reasoning_end(ids)
    assert not parser.is_reasoning_end(ids + [start])  # a new thought opened
    assert parser.is_reasoning_end_streaming(ids, [end])
    assert parser.extract_content_ids(ids) == ids[cut + 1 :]
    assert parser.extract_content_ids(ids[: cut + 1]) == []  # nothing after the end yet
    assert parser.count_reasoning_tokens(ids) == cut - 1


# Qwen3 (thinking on by default; its template may open <think> in the prompt)
QWEN3 = [
    ("<think>This is a reasoning section</think>This is the rest", "This is a reasoning section", "This is the rest"),
    ("This is a reasoning section</think>This is the rest", "This is a reasoning section", "This is the rest"),
    ("<think>\nLet me think.\n</think>\n\nHello!", "\nLet me think.\n", "\n\nHello!"),
    ("Just thinking, no end", "Just thinking, no end", None),
    ("<think>plan</think>Answer</think> more", "plan", "Answer more"),  # a stray </think> dropped
    (
        '<think>I need the weather.<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>',
        "I need the weather.",
        '<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>',
    ),
]  # fmt: skip


@pytest.mark.parametrize("special", [False, True], ids=["text-markers", "special-tokens"])
@pytest.mark.parametrize("mode", STREAM_MODES)
@pytest.mark.parametrize(("text", "reasoning", "content"), QWEN3)
def test_qwen3(text, reasoning, content, mode, special, make_tokenizer):
    tokenizer = (
        make_tokenizer(*THINK_TOKENS, "<tool_call>", "</tool_call>")
        if special
        else make_tokenizer()
    )
    parser_cls = ReasoningParserManager.get_reasoning_parser("qwen3")
    assert parser_cls(tokenizer).extract_reasoning(text, Request()) == (reasoning, content)
    parser = parser_cls(tokenizer)
    assert _split(stream_reasoning_parser(parser, tokenizer, text, mode)) == (reasoning, content)
    assert parser.reasoning_ended() == ("</think>" in text or "<tool_call>" in text)


def test_qwen3_thinking_off(plain_tokenizer):
    parser_cls = ReasoningParserManager.get_reasoning_parser("qwen3")
    parser = parser_cls(plain_tokenizer, chat_template_kwargs={"enable_thinking": False})
    assert parser.extract_reasoning("Hello there", Request()) == (None, "Hello there")
    assert parser.is_reasoning_end([]) and parser.reasoning_ended()
    replay = stream_reasoning_parser(parser, plain_tokenizer, "Hello there")
    assert _split(replay) == (None, "Hello there")


def test_qwen3_whitespace_answer_waits_for_text(plain_tokenizer):
    parser = ReasoningParserManager.get_reasoning_parser("qwen3")(plain_tokenizer)
    assert (
        parser.extract_reasoning_streaming("", "a</think>", "a</think>", [], [], []).reasoning
        == "a"
    )
    assert parser.extract_reasoning_streaming("", "a</think>\n\n", "\n\n", [], [], []) is None
    delta = parser.extract_reasoning_streaming("", "a</think>\n\nHi", "Hi", [], [], [])
    assert delta.content == "\n\nHi"


def test_qwen3_token_queries(make_tokenizer):
    tokenizer = make_tokenizer(*THINK_TOKENS, "<tool_call>")
    parser = ReasoningParserManager.get_reasoning_parser("qwen3")(tokenizer)
    ids = tokenizer.encode("<think>a b</think>answer", add_special_tokens=False)
    end = ids.index(parser.end_token_id)
    assert not parser.is_reasoning_end(ids[:end]) and parser.is_reasoning_end(ids)
    assert parser.extract_content_ids(ids) == ids[end + 1 :]
    assert parser.count_reasoning_tokens(ids) == end - 1
    prompt = tokenizer.encode("<|im_start|>assistant\n", add_special_tokens=False)
    assert not parser.is_reasoning_end(prompt)  # thinking: the thought is still to come
    tool_ids = tokenizer.encode("plan<tool_call>{}", add_special_tokens=False)
    assert parser.is_reasoning_end(tool_ids)
    assert (
        parser.extract_content_ids(tool_ids)
        == tool_ids[tool_ids.index(tokenizer.convert_tokens_to_ids("<tool_call>")) :]
    )


def test_qwen3_counts_reasoning_tokens_without_think_tokens(plain_tokenizer):
    parser = ReasoningParserManager.get_reasoning_parser("qwen3")(plain_tokenizer)
    thought = plain_tokenizer.encode("one two three", add_special_tokens=False)
    ids = plain_tokenizer.encode("one two three</think>answer", add_special_tokens=False)
    assert parser.count_reasoning_tokens(ids) == len(thought)
    opened = plain_tokenizer.encode("<think>one two three</think>answer", add_special_tokens=False)
    assert parser.count_reasoning_tokens(opened) == len(thought)
    assert parser.count_reasoning_tokens(thought) == len(thought)  # still thinking


def test_qwen3_then_the_tool_parser_on_the_answer(plain_tokenizer):
    """The thought is split off first; the tool parser runs on the answer only."""
    reasoning = ReasoningParserManager.get_reasoning_parser("qwen3")(plain_tokenizer)
    tools = ToolParserManager.get_tool_parser("hermes")(plain_tokenizer)
    text = 'Need a tool.</think>\n<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'
    thought, answer = reasoning.extract_reasoning(text, Request())
    result = tools.safe_extract_tool_calls(answer, Request())
    assert thought == "Need a tool." and result.tool_calls[0].function.name == "f"


# Olmo 3: <think>/</think> are plain text there
OLMO3 = [
    ("<think>This is a reasoning section</think>This is the rest", "This is a reasoning section", "This is the rest"),
    ("This is a reasoning section</think>This is the rest", "This is a reasoning section", "This is the rest"),
    ("<think>\nThink step by step.\n</think>\n\nThe answer is 4.", "\nThink step by step.\n", "\n\nThe answer is 4."),
    ("No reasoning markers here.", None, "No reasoning markers here."),
]  # fmt: skip


@pytest.mark.parametrize(("text", "reasoning", "content"), OLMO3)
def test_olmo3_non_streamed(text, reasoning, content, plain_tokenizer):
    parser = ReasoningParserManager.get_reasoning_parser("olmo3")(plain_tokenizer)
    assert parser.extract_reasoning(text, Request()) == (reasoning, content)


@pytest.mark.parametrize("mode", ["tokens", "chars1", "chars3"])
@pytest.mark.parametrize(("text", "reasoning", "content"), OLMO3[:3])
def test_olmo3_streamed(text, reasoning, content, mode, plain_tokenizer):
    parser = ReasoningParserManager.get_reasoning_parser("olmo3")(plain_tokenizer)
    assert _split(stream_reasoning_parser(parser, plain_tokenizer, text, mode)) == (
        reasoning,
        content,
    )


def test_olmo3_reasoning_end_by_the_marker_pieces(plain_tokenizer):
    parser = ReasoningParserManager.get_reasoning_parser("olmo3")(plain_tokenizer)
    ids = plain_tokenizer.encode("thinking </think> answer", add_special_tokens=False)
    assert parser.is_reasoning_end(ids)
    assert not parser.is_reasoning_end(plain_tokenizer.encode("thinking", add_special_tokens=False))
    assert parser.extract_content_ids(ids) == []
