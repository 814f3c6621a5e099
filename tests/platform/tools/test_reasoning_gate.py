"""With a reasoning parser, a request's grammar waits for the end of the thought (the
engine's ``reasoning_end``), unless the prompt already closed it."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from loramux.engine.sampling_params import SamplingParams
from loramux.engine.structured_params import StructuredOutputsParams
from loramux.platform.openai.chat_output import ChatParsing
from loramux.platform.openai.parsers import ReasoningParserManager
from loramux.platform.openai.reasoning_gate import gate_after_thought, thought_end_ids
from loramux.platform.openai.tool_request import ToolPlan


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def _params() -> SamplingParams:
    return SamplingParams(max_tokens=8, structured_outputs=StructuredOutputsParams(
        json={"type": "object"}))


def test_the_end_marker_spells_think_end(tok):
    for seq in thought_end_ids(tok, "</think>"):
        assert tok.decode(seq).strip() == "</think>"


@pytest.mark.parametrize("parser", ["qwen3", "olmo3"])
def test_gate_set_while_the_thought_is_open(tok, parser):
    parsing = ChatParsing(ToolPlan(), ReasoningParserManager.get_reasoning_parser(parser), tok)
    prompt = tok("<|im_start|>assistant\n", add_special_tokens=False).input_ids
    gated = gate_after_thought(_params(), parsing, prompt)
    assert gated.structured_outputs.reasoning_end == thought_end_ids(tok, "</think>")
    assert gated.structured_outputs.json == {"type": "object"}


def test_no_gate_without_a_grammar_or_once_the_prompt_closed_it(tok):
    parsing = ChatParsing(ToolPlan(), ReasoningParserManager.get_reasoning_parser("olmo3"), tok)
    plain = SamplingParams(max_tokens=8)
    assert gate_after_thought(plain, parsing, [1, 2]) is plain
    closed = tok("<think>x</think>", add_special_tokens=False).input_ids
    params = _params()
    assert gate_after_thought(params, parsing, closed).structured_outputs.reasoning_end is None
