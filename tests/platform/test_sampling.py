"""Request + preset → SamplingParams: precedence, aliases, header, warnings, validation."""

from __future__ import annotations

import json

import pytest

from loramux.engine.errors import SamplingParamError
from loramux.platform.error_handlers import to_api_error
from loramux.platform.errors import BadRequest
from loramux.platform.openai.params import build_params
from loramux.platform.openai.presets import validate_preset
from loramux.platform.openai.protocol import ChatCompletionRequest, CompletionRequest


def cmpl(**kw) -> CompletionRequest:
    return CompletionRequest(model="m", prompt="x", **kw)


def chat(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}], **kw)


def test_defaults_differ_by_endpoint():
    assert build_params(cmpl(), None, default_max_tokens=16).params.max_tokens == 16
    assert build_params(chat(), None, default_max_tokens=None).params.max_tokens is None


def test_preset_fills_request_overrides():
    preset = {"temperature": 0.0, "stop": [";"], "top_k": 5}
    built = build_params(cmpl(temperature=0.9), preset, default_max_tokens=16)
    p = built.params
    assert p.temperature == 0.9 and p.stop_strings == [";"] and p.top_k == 5
    assert built.preset_fields == ["stop", "top_k"]
    headers = built.headers()
    assert headers["X-LoRAMux-Preset"] == "stop,top_k"
    eff = json.loads(headers["X-LoRAMux-Params"])
    assert eff["temperature"] == 0.9 and eff["stop"] == [";"]


def test_explicit_null_means_unset():
    built = build_params(cmpl(temperature=None), {"temperature": 0.0}, default_max_tokens=16)
    assert built.params.temperature == 0.0 and built.preset_fields == ["temperature"]


def test_max_completion_tokens_wins_with_warning():
    built = build_params(chat(max_tokens=5, max_completion_tokens=7), None, default_max_tokens=None)
    assert built.params.max_tokens == 7
    assert any("max_tokens had no effect" in w for w in built.warnings)


def test_chat_logprobs_mapping():
    assert build_params(chat(logprobs=True), None, default_max_tokens=None).params.logprobs == 0
    p = build_params(chat(logprobs=True, top_logprobs=4), None, default_max_tokens=None).params
    assert p.logprobs == 4
    built = build_params(chat(top_logprobs=4), None, default_max_tokens=None)
    assert built.params.logprobs is None and built.warnings


def test_logit_bias_and_negative_seed():
    p = build_params(cmpl(logit_bias={"12": -5}, seed=-1, temperature=1.0), None,
                     default_max_tokens=16).params
    assert p.logit_bias == {12: -5.0} and p.seed == 2**63 - 1
    with pytest.raises(SamplingParamError) as e:  # answered by the error table's row
        build_params(cmpl(logit_bias={"abc": 1}), None, default_max_tokens=16)
    assert to_api_error(e.value).param == "logit_bias"


@pytest.mark.parametrize("field,value", [
    ("temperature", -0.5), ("top_p", 1.5), ("min_p", 2.0), ("presence_penalty", 3.0),
    ("repetition_penalty", 0.0), ("n", 0), ("min_tokens", -1), ("max_tokens", 0),
])
def test_bad_values_name_their_parameter(field, value):
    with pytest.raises(SamplingParamError) as e:
        build_params(cmpl(**{field: value}), None, default_max_tokens=16)
    err = to_api_error(e.value)  # the error table's answer
    assert (err.param, err.status_code, err.code) == (field, 400, "invalid_parameter")


def test_no_effect_warnings():
    built = build_params(cmpl(temperature=0, top_k=4, min_p=0.1, seed=3,
                              include_stop_str_in_output=True, stream_options={"include_usage": True},
                              suffix="!", bogus=1), None, default_max_tokens=16)
    text = " | ".join(built.warnings)
    for name in ("top_k", "min_p", "seed", "include_stop_str_in_output", "stream_options",
                 "suffix", "bogus"):
        assert f"{name} had no effect" in text
    quiet = build_params(cmpl(temperature=0.7, top_k=4, seed=3), None, default_max_tokens=16)
    assert quiet.warnings == [] and "X-LoRAMux-Warnings" not in quiet.headers()


def test_header_is_ascii_and_bounded():
    built = build_params(cmpl(stop=["é" * 50] * 200, temperature=0.5), None, default_max_tokens=16)
    value = built.headers()["X-LoRAMux-Params"]
    assert value.isascii() and len(value) <= 4000


def test_validate_preset():
    assert validate_preset({"temperature": 0, "stop": [";"]}) == {"temperature": 0, "stop": [";"]}
    assert validate_preset(None) == {}
    with pytest.raises(BadRequest) as e:
        validate_preset({"warmth": 1})
    assert e.value.param == "preset.warmth"
    with pytest.raises(BadRequest) as e:
        validate_preset({"top_p": 0})
    assert e.value.param == "preset.top_p"
    with pytest.raises(BadRequest):
        validate_preset(["temperature"])


def test_request_and_preset_schema_derive_from_sampling_params():
    from dataclasses import fields

    from loramux.engine.sampling_params import SamplingParams
    from loramux.platform.openai import params, presets
    from loramux.platform.openai.protocol import SamplingFields

    engine = {f.name for f in fields(SamplingParams) if f.init}
    assert set(params.DIRECT_FIELDS) == engine - {"detokenize", "structured_outputs", "logprobs"}
    assert set(params.DIRECT_FIELDS) <= set(SamplingFields.model_fields)
    assert presets.PRESET_FIELDS <= engine
    for name in presets.PRESET_FIELDS:  # every preset field is one a request may also set
        assert name in SamplingFields.model_fields or name == "logprobs"


def test_spaces_between_special_tokens_is_reported_as_no_effect():
    built = build_params(cmpl(spaces_between_special_tokens=False), None, default_max_tokens=16)
    assert any(w.startswith("spaces_between_special_tokens had no effect") for w in built.warnings)
    built = build_params(cmpl(spaces_between_special_tokens=True), None, default_max_tokens=16)
    assert not built.warnings
