"""``LLM.chat(..., tools=...)``: the tools reach the chat template, as in vLLM."""

from __future__ import annotations

from loramux.engine.sampling_params import SamplingParams

TEMPLATE = ("{% for t in tools or [] %}[tool {{ t.function.name }}]{% endfor %}"
            "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>")
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}


def test_chat_renders_tools(tiny_model_dir):
    from loramux.engine import LLM

    llm = LLM(str(tiny_model_dir), dtype="float32", max_model_len=128)
    tok = llm.llm_engine.tokenizer
    messages = [{"role": "user", "content": "Weather?"}]
    params = SamplingParams(temperature=0, max_tokens=2)
    with_tools = llm.chat(messages, params, chat_template=TEMPLATE, tools=[WEATHER])[0]
    without = llm.chat(messages, params, chat_template=TEMPLATE)[0]
    expected = tok("[tool get_weather]<user>Weather?<assistant>", add_special_tokens=False)
    assert with_tools.prompt_token_ids == expected.input_ids
    assert without.prompt_token_ids == tok("<user>Weather?<assistant>",
                                           add_special_tokens=False).input_ids
