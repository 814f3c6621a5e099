"""``tools`` / ``tool_choice`` checks and plans (vLLM 0.32's messages and semantics)."""

from __future__ import annotations

import json

import pytest

from loramux.platform.errors import BadRequest
from loramux.platform.openai.protocol import ChatCompletionRequest
from loramux.platform.openai.tool_config import ParsingConfig, parse_structured_outputs_config
from loramux.platform.openai.tool_request import AUTO_NEEDS_PARSER, generic_schema, plan_tools

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
        "$defs": {"Unit": {"enum": ["c", "f"]}}}}}
TIME = {"type": "function", "function": {"name": "get_time"}}
HERMES = ParsingConfig(enable_auto_tool_choice=True, tool_call_parser="hermes")
PYTHONIC = ParsingConfig(enable_auto_tool_choice=True, tool_call_parser="pythonic")


def req(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], **kw)


def refused(config: ParsingConfig, **kw) -> BadRequest:
    with pytest.raises(BadRequest) as info:
        plan_tools(req(**kw), config, max_tools=8)
    return info.value


def test_defaults_auto_with_tools_and_none_without():
    assert plan_tools(req(tools=[WEATHER]), HERMES, 8).choice == "auto"
    assert plan_tools(req(), HERMES, 8).choice == "none"
    assert plan_tools(req(tools=[WEATHER], tool_choice="none"), ParsingConfig(), 8).parses is False


def test_auto_needs_a_parser():
    err = refused(ParsingConfig(), tools=[WEATHER])
    assert str(err) == AUTO_NEEDS_PARSER and err.param == "tool_choice"
    err = refused(ParsingConfig(tool_call_parser="hermes"), tools=[WEATHER], tool_choice="auto")
    assert str(err) == AUTO_NEEDS_PARSER


def test_an_adapter_parser_turns_auto_on():
    plan = plan_tools(req(tools=[WEATHER]), ParsingConfig().for_model("hermes", None), 8)
    assert plan.choice == "auto" and plan.parser is not None and plan.parser_name == "hermes"


@pytest.mark.parametrize("kw, message", [
    (dict(tool_choice="auto"), "When using `tool_choice`, `tools` must be set."),
    (dict(tools=[WEATHER], tool_choice="sometimes"), "Invalid value for `tool_choice`: sometimes!"),
    (dict(tools=[WEATHER], tool_choice={"type": "function"}), "Invalid value for `function`"),
    (dict(tools=[WEATHER], tool_choice={"type": "function", "function": {}}),
     "Expected field `name` in `function`"),
    (dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": ""}}),
     "Invalid `name` in `function`"),
    (dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}),
     "The tool specified in `tool_choice` does not match any of the specified `tools`"),
])
def test_bad_tool_choice_is_a_400_naming_it(kw, message):
    err = refused(HERMES, **kw)
    assert message in str(err) and err.param == "tool_choice" and err.status_code == 400


def test_too_many_tools():
    err = refused(HERMES, tools=[WEATHER] * 9)
    assert err.param == "tools" and "max_tools" in str(err)


def test_required_without_tools_is_none():
    plan = plan_tools(req(tools=[], tool_choice="required"), HERMES, 8)
    assert plan.choice == "none" and plan.constraint is None


def test_required_generic_schema_hoists_defs_and_honours_parallel():
    schema = generic_schema("required", None, req(tools=[WEATHER, TIME]).tools, parallel=False)
    assert schema["minItems"] == 1 and schema["maxItems"] == 1
    assert schema["$defs"] == {"Unit": {"enum": ["c", "f"]}}
    names = [i["properties"]["name"]["enum"] for i in schema["items"]["anyOf"]]
    assert names == [["get_weather"], ["get_time"]]
    assert schema["items"]["anyOf"][1]["properties"]["parameters"] == {"type": "object",
                                                                       "properties": {}}
    assert "$defs" in req(tools=[WEATHER]).tools[0].function.parameters


def test_named_and_required_use_generic_json_without_a_structural_tag_format():
    for config in (ParsingConfig(), PYTHONIC):
        named = plan_tools(req(tools=[WEATHER], tool_choice={
            "type": "function", "function": {"name": "get_weather"}}), config, 8)
        assert named.generic and named.constraint.json["required"] == ["city"]
        required = plan_tools(req(tools=[WEATHER], tool_choice="required"), config, 8)
        assert required.generic and required.constraint.json["type"] == "array"


def test_structural_tag_formats_constrain_required_and_strict_auto():
    plan = plan_tools(req(tools=[WEATHER], tool_choice="required"), HERMES, 8)
    assert not plan.generic and plan.parser is not None
    tag = plan.constraint.structural_tag
    tag = json.loads(tag) if isinstance(tag, str) else tag
    assert tag["format"]["type"] == "tags_with_separator" and tag["format"]["at_least_one"]
    # auto: constrained only for a strict tool (or --tool-strict-level function)
    assert plan_tools(req(tools=[WEATHER]), HERMES, 8).constraint is None
    strict = {"type": "function", "function": {**WEATHER["function"], "strict": True}}
    assert plan_tools(req(tools=[strict]), HERMES, 8).constraint is not None
    level = ParsingConfig(enable_auto_tool_choice=True, tool_call_parser="hermes",
                          tool_strict_level="function")
    assert plan_tools(req(tools=[WEATHER]), level, 8).constraint is not None


def test_structured_outputs_config_refuses_what_it_does_not_do():
    assert parse_structured_outputs_config('{"enable_in_reasoning": true}') == {
        "enable_in_reasoning": True}
    for bad in ('{"backend": "outlines"}', '{"disable_fallback": true}', "[1]", "{"):
        with pytest.raises(ValueError, match="structured_outputs_config"):
            parse_structured_outputs_config(bad)
