"""Tool calling and reasoning on /v1/chat/completions through the official ``openai``
client against a live server. The tiny random model's text is forced with a regex
(``structured_outputs``) so the parsers see the formats the models document."""

from __future__ import annotations

import json

import openai
import pytest
from support.forced_text import regex_literal
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


UNIT = {"type": "function", "function": {
    "name": "set_unit", "strict": True, "parameters": {
        "type": "object", "properties": {"unit": {"enum": ["c", "f"]}}, "required": ["unit"],
        "additionalProperties": False}}}
MODE = {"type": "function", "function": {
    "name": "set_mode", "strict": True, "parameters": {
        "type": "object", "properties": {"mode": {"enum": ["fast", "slow"]}},
        "required": ["mode"], "additionalProperties": False}}}


def _no_whitespace(tokenizer) -> dict[str, float]:
    """A logit bias that keeps a random model from padding constrained JSON with
    whitespace (a real model writes compact JSON; this one would fill max_tokens)."""
    ids = [i for tok, i in tokenizer.get_vocab().items()
           if tokenizer.convert_tokens_to_string([tok]).isspace()]
    return {str(i): -100.0 for i in ids[:300]}


def _regex(text: str) -> str:
    return regex_literal(text)


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
def bias(engine) -> dict[str, float]:
    return _no_whitespace(engine.tokenizer)


@pytest.fixture(scope="module")
def plain(engine):
    """No tool parser: required / named use vLLM's generic JSON."""
    app = _serve(engine, trust_request_chat_template=True)
    with serve_in_thread(app) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
    close_state(app.services)


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
    kw.setdefault("extra_body", _forced(text))
    return client.chat.completions.create(
        model=BASE, messages=[{"role": "user", "content": "Weather in Paris?"}],
        max_tokens=120, temperature=0, **kw)


def _stream(client, text: str, **kw):
    kw.setdefault("tools", [WEATHER, TIME])
    kw.setdefault("extra_body", _forced(text))
    return list(client.chat.completions.create(
        model=BASE, messages=[{"role": "user", "content": "Weather in Paris?"}],
        max_tokens=120, temperature=0, stream=True, **kw))


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


def _both(client, bias, **kw):
    base = dict(model=BASE, messages=[{"role": "user", "content": "Set it up."}], max_tokens=60,
                temperature=0, extra_body={"logit_bias": bias})
    base.update(kw)
    out = client.chat.completions.create(**base)
    chunks = list(client.chat.completions.create(**base, stream=True))
    return out, _rebuild(chunks)


def _calls(message) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]


def _streamed(calls) -> list[tuple[str, dict]]:
    return [(c["name"], json.loads(c["arguments"])) for c in calls]


@pytest.mark.parametrize("server", ["plain", "hermes"])
def test_required_calls_a_tool(server, request, bias):
    client = request.getfixturevalue(server)
    out, (content, _, calls, finish) = _both(client, bias, tools=[UNIT, MODE],
                                             tool_choice="required")
    msg = out.choices[0].message
    assert out.choices[0].finish_reason == "tool_calls" == finish
    assert _calls(msg) and all(name in ("set_unit", "set_mode") for name, _ in _calls(msg))
    for name, args in _calls(msg):
        assert args in ([{"unit": "c"}, {"unit": "f"}] if name == "set_unit" else
                        [{"mode": "fast"}, {"mode": "slow"}])
    assert _streamed(calls) == _calls(msg) and not msg.content and not content


@pytest.mark.parametrize("server", ["plain", "hermes"])
def test_named_function_ends_with_stop(server, request, bias):
    client = request.getfixturevalue(server)
    choice = {"type": "function", "function": {"name": "set_mode"}}
    out, (_, _, calls, finish) = _both(client, bias, tools=[UNIT, MODE], tool_choice=choice)
    msg = out.choices[0].message
    assert out.choices[0].finish_reason == "stop" == finish
    assert len(_calls(msg)) == 1 and _calls(msg)[0][0] == "set_mode"
    assert _calls(msg)[0][1] in ({"mode": "fast"}, {"mode": "slow"})
    assert _streamed(calls) == _calls(msg)


def test_parallel_tool_calls_false_keeps_one(hermes):
    out = _chat(hermes, HERMES_TWO, parallel_tool_calls=False)
    assert [c.function.name for c in out.choices[0].message.tool_calls] == ["get_weather"]
    _, _, calls, _ = _rebuild(_stream(hermes, HERMES_TWO, parallel_tool_calls=False))
    assert [c["name"] for c in calls] == ["get_weather"]


def test_tool_choice_none_is_plain_content(hermes):
    out = _chat(hermes, "</think>" + HERMES_TWO, tool_choice="none")
    msg = out.choices[0].message
    assert not msg.tool_calls and msg.content == HERMES_TWO
    assert out.choices[0].finish_reason == "stop"


def test_malformed_call_is_content_and_counted(hermes):
    text = '</think>Sure<tool_call>{"name": get_weather}</tool_call>'
    out = _chat(hermes, text)
    msg = out.choices[0].message
    assert out.choices[0].finish_reason == "stop" and not msg.tool_calls
    assert msg.content == text[len("</think>"):]
    content, _, calls, finish = _rebuild(_stream(hermes, text))
    assert finish == "stop" and not calls


def test_auto_without_a_parser_is_refused(plain):
    with pytest.raises(openai.BadRequestError) as info:
        plain.chat.completions.create(model=BASE, messages=[{"role": "user", "content": "x"}],
                                      tools=[WEATHER], max_tokens=4)
    err = info.value.body
    assert err["param"] == "tool_choice" and "--enable-auto-tool-choice" in err["message"]


@pytest.mark.parametrize("tools, choice, param", [
    ([{"type": "code_interpreter"}], None, "tools"),
    ([{"type": "function", "function": {"description": "no name"}}], None, "tools"),
    ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "tool_choice"),
])
def test_bad_tools_are_400s_naming_the_field(plain, tools, choice, param):
    kw = {"tool_choice": choice} if choice is not None else {}
    with pytest.raises(openai.BadRequestError) as info:
        plain.chat.completions.create(model=BASE, messages=[{"role": "user", "content": "x"}],
                                      tools=tools, max_tokens=4, **kw)
    assert (info.value.body.get("param") or "").startswith(param)


TOOL_TEMPLATE = (
    "{% for t in tools or [] %}[tool {{ t.function.name }}]{% endfor %}"
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}"
    "{% for c in m.tool_calls or [] %}[call {{ c.function.name }} {{ c.function.arguments.city }}]"
    "{% endfor %}{% if m.tool_call_id %}[for {{ m.tool_call_id }}]{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}")


def test_follow_up_turns_render_calls_and_results(plain):
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    out = plain.chat.completions.create(
        model=BASE, messages=messages, tools=[WEATHER], tool_choice="none", max_tokens=2,
        extra_body={"chat_template": TOOL_TEMPLATE})
    expected = ("[tool get_weather]<user>Weather in Paris?<assistant>[call get_weather Paris]"
                "<tool>sunny[for call_1]<assistant>")
    assert out.usage.prompt_tokens == _count(plain, expected)


def _count(client, text: str) -> int:
    out = client.completions.create(model=BASE, prompt=text, max_tokens=1)
    return out.usage.prompt_tokens


@pytest.fixture(scope="module")
def pythonic(engine):
    app = _serve(engine, enable_auto_tool_choice=True, tool_call_parser="pythonic",
                 reasoning_parser="olmo3",
                 structured_outputs_config='{"enable_in_reasoning": true}')
    with serve_in_thread(app) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
    close_state(app.services)


@pytest.fixture(scope="module")
def qwen_xml(engine):
    app = _serve(engine, enable_auto_tool_choice=True, tool_call_parser="qwen3_xml")
    with serve_in_thread(app) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
    close_state(app.services)


def test_pythonic_calls_after_an_olmo3_thought(pythonic):
    text = "<think>two calls</think>[get_weather(city='Paris', days=3), get_time(tz='UTC')]"
    out = _chat(pythonic, text)
    msg = out.choices[0].message
    assert msg.model_extra.get("reasoning") == "two calls"
    assert _calls(msg) == [("get_weather", {"city": "Paris", "days": 3}),
                           ("get_time", {"tz": "UTC"})]
    assert out.choices[0].finish_reason == "tool_calls" and not msg.content
    content, reasoning, calls, finish = _rebuild(_stream(pythonic, text))
    assert (reasoning, finish, _streamed(calls)) == ("two calls", "tool_calls", _calls(msg))
    assert not content


def test_qwen3_xml_types_values_by_the_schema(qwen_xml):
    text = ("I will check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
            "</parameter>\n<parameter=days>\n4\n</parameter>\n</function>\n</tool_call>")
    out = _chat(qwen_xml, text)
    msg = out.choices[0].message
    assert _calls(msg) == [("get_weather", {"city": "Paris", "days": 4})]
    assert msg.content == "I will check."
    _, _, calls, finish = _rebuild(_stream(qwen_xml, text))
    assert finish == "tool_calls" and _streamed(calls) == _calls(msg)


def test_include_reasoning_false_drops_the_thought(hermes):
    text = "secret plan</think>Done."
    out = _chat(hermes, text, extra_body={**_forced(text), "include_reasoning": False})
    assert out.choices[0].message.content == "Done."
    assert not out.choices[0].message.model_extra.get("reasoning")
    assert out.usage.completion_tokens_details.reasoning_tokens > 0
    content, reasoning, _, _ = _rebuild(_stream(hermes, text, extra_body={
        **_forced(text), "include_reasoning": False}))
    assert (content, reasoning) == ("Done.", "")


def test_qwen3_without_thinking_has_no_thought(hermes):
    out = hermes.chat.completions.create(
        model=BASE, messages=[{"role": "user", "content": "hi"}], max_tokens=40, temperature=0,
        extra_body={**_forced("Plain answer."), "chat_template_kwargs": {"enable_thinking": False}})
    msg = out.choices[0].message
    assert msg.content == "Plain answer." and not msg.model_extra.get("reasoning")
    assert out.usage.completion_tokens_details.reasoning_tokens == 0


@pytest.mark.parametrize("flags, message", [
    (dict(enable_auto_tool_choice=True, tool_call_parser="llama3_json"), "<|python_tag|>"),
    (dict(reasoning_parser="deepseek_r1"), "--reasoning-parser deepseek_r1"),
    (dict(enable_auto_tool_choice=True, tool_call_parser="nope"), "invalid tool call parser"),
    (dict(enable_auto_tool_choice=True), "requires --tool-call-parser"),
    (dict(reasoning_parser="nope"), "invalid reasoning parser"),
])
def test_start_up_refusals(engine, flags, message):
    from loramux.platform.openai.parsers import ParserStartupError

    with pytest.raises(ParserStartupError, match=message.replace("|", r"\|")):
        _serve(engine, **flags)


@pytest.fixture(scope="module")
def marker_engine(tiny_model_dir, tmp_path_factory):
    from support.tool_tokens import with_marker_tokens

    folder = with_marker_tokens(tiny_model_dir, tmp_path_factory.mktemp("markers"))
    eng = make_engine(folder, max_model_len=512, max_num_seqs=8)
    yield eng
    eng.shutdown()


def _marker_bias(engine) -> dict[str, float]:
    """Prefer each marker's own token where the grammar allows it (not its pieces)."""
    vocab = engine.tokenizer.get_vocab()
    return {str(vocab[m]): 30.0 for m in ("<|python_tag|>", "[TOOL_CALLS]", "<think>", "</think>")}


@pytest.mark.parametrize("parser, reasoning, text, content", [
    ("llama3_json", "deepseek_r1",
     '<think>plan</think><|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}',
     None),
    ("mistral", None,
     'Checking.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]',
     "Checking."),
])
def test_marker_token_parsers(marker_engine, parser, reasoning, text, content):
    app = _serve(marker_engine, enable_auto_tool_choice=True, tool_call_parser=parser,
                 reasoning_parser=reasoning,
                 structured_outputs_config='{"enable_in_reasoning": true}')
    kw = dict(model=BASE, messages=[{"role": "user", "content": "Weather in Paris?"}],
              tools=[WEATHER], max_tokens=80, temperature=0,
              extra_body={**_forced(text), "logit_bias": _marker_bias(marker_engine)})
    try:
        with serve_in_thread(app) as url:
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
            out = client.chat.completions.create(**kw)
            streamed = _rebuild(list(client.chat.completions.create(**kw, stream=True)))
    finally:
        close_state(app.services)
    msg = out.choices[0].message
    assert _calls(msg) == [("get_weather", {"city": "Paris"})], msg
    assert (msg.content or None) == content and out.choices[0].finish_reason == "tool_calls"
    if reasoning:
        assert msg.model_extra.get("reasoning") == "plan"
    s_content, s_reasoning, calls, finish = streamed
    assert _streamed(calls) == _calls(msg) and finish == "tool_calls"
    assert (s_content or None) == content and (s_reasoning or None) == (msg.model_extra.get("reasoning"))


PLUGIN = '''
from loramux.platform.openai.parsers import ToolParser, ToolParserManager
from loramux.platform.openai.parsers.types import ExtractedToolCalls, FunctionCall, ToolCall


@ToolParserManager.register_module("shout")
class ShoutParser(ToolParser):
    """CALL name ARGS {json}"""

    def extract_tool_calls(self, model_output, request):
        if not model_output.startswith("CALL "):
            return ExtractedToolCalls(False, [], model_output)
        name, _, args = model_output[5:].partition(" ARGS ")
        return ExtractedToolCalls(True, [ToolCall(FunctionCall(name, args))], None)

    def extract_tool_calls_streaming(self, *args, **kwargs):
        return None
'''


def test_a_tool_parser_plugin(engine, tmp_path):
    path = tmp_path / "shout_parser.py"
    path.write_text(PLUGIN)
    app = _serve(engine, enable_auto_tool_choice=True, tool_call_parser="shout",
                 tool_parser_plugin=str(path))
    try:
        with serve_in_thread(app) as url:
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
            out = _chat(client, 'CALL get_weather ARGS {"city": "Rome"}')
    finally:
        close_state(app.services)
    assert _calls(out.choices[0].message) == [("get_weather", {"city": "Rome"})]
    assert out.choices[0].finish_reason == "tool_calls"
