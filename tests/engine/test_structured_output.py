"""Structured outputs: every constrained completion satisfies its constraint."""

from __future__ import annotations

import json
import re

import pytest


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    from loramux.engine import LLM

    return LLM(str(tiny_model_dir), dtype="float32", max_model_len=256)


def test_choice_and_regex_hold_even_for_a_random_model(llm):
    from loramux.engine import SamplingParams

    choice = SamplingParams(temperature=1.0, seed=3, max_tokens=20, structured_outputs={"choice": ["alpha", "beta gamma"]})
    regex = SamplingParams(temperature=1.0, seed=4, max_tokens=30, structured_outputs={"regex": r"[0-9]{3}-[a-z]{2}"})
    outs = llm.generate(["Pick:", "Code:"] * 3, [choice, regex] * 3)
    for i, out in enumerate(outs):
        text = out.outputs[0].text
        if i % 2 == 0:
            assert text in ("alpha", "beta gamma")
        else:
            assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", text), text
        assert out.outputs[0].finish_reason == "stop"


def test_json_schema_output_parses(llm):
    from loramux.engine import SamplingParams

    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    out = llm.generate(["JSON:"], SamplingParams(temperature=0, max_tokens=60, structured_outputs={"json": schema}))[0]
    comp = out.outputs[0]
    if comp.finish_reason == "stop":
        assert isinstance(json.loads(comp.text)["ok"], bool)
    else:  # cut by max_tokens: still a prefix the grammar allows
        assert comp.text.lstrip().startswith("{")


def test_invalid_constraints_are_value_errors(llm):
    from loramux.engine import SamplingParams

    with pytest.raises(ValueError, match="structured_outputs"):
        SamplingParams(structured_outputs={"regex": "a", "choice": ["b"]})
    with pytest.raises(ValueError, match="choice"):
        SamplingParams(structured_outputs={"choice": []})
    with pytest.raises(ValueError, match="invalid constraint"):
        llm.generate(["x"], SamplingParams(structured_outputs={"regex": "(unclosed"}))
