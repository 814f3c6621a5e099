"""RequestLimits: defaults are valid, bad settings are refused, every cap names its field."""

from __future__ import annotations

import dataclasses

import pytest

from loramux.engine.sampling_params import SamplingParams
from loramux.platform.limits.request import (
    RequestLimitError,
    RequestLimits,
    check_chat_template,
    check_request,
)

LIMITS = RequestLimits()


def test_settings_validation():
    for f in dataclasses.fields(RequestLimits):
        bad = 1 if f.type == "bool" else 0
        with pytest.raises(ValueError, match=f.name):
            RequestLimits(**{f.name: bad})
    with pytest.raises(ValueError, match="max_stop"):
        RequestLimits(max_stop=True)
    with pytest.raises(ValueError, match="chat_template_render_timeout_s"):
        RequestLimits(chat_template_render_timeout_s=float("nan"))
    with pytest.raises(dataclasses.FrozenInstanceError):
        LIMITS.max_stop = 3  # type: ignore[misc]


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(),
        SamplingParams(stop=["x" * 256] * 16, stop_token_ids=list(range(256)),
                       allowed_token_ids=list(range(4096)),
                       logit_bias={i: 1.0 for i in range(300)}),
        SamplingParams(n=32, best_of=32),
        SamplingParams(n=2, best_of=4, prompt_logprobs=20, temperature=1.0),
        SamplingParams(stop="one string"),
        SamplingParams(structured_outputs={"regex": "[a-z]{1,64}"}),
    ],
)
def test_within_limits(params):
    check_request(params, LIMITS)


@pytest.mark.parametrize(
    ("params", "param", "match"),
    [
        (SamplingParams(stop=[str(i) for i in range(100_000)]), "stop", "100000 strings"),
        (SamplingParams(stop=["x" * 257]), "stop", "257 characters"),
        (SamplingParams(stop_token_ids=list(range(257))), "stop_token_ids", "257 ids"),
        (SamplingParams(allowed_token_ids=list(range(4097))), "allowed_token_ids", "4097"),
        (SamplingParams(logit_bias={i: 0.5 for i in range(301)}), "logit_bias", "301 entries"),
        (SamplingParams(n=64, best_of=64), "n", "4096"),
        (SamplingParams(n=8, best_of=16, prompt_logprobs=20), "n", "2560"),
        (SamplingParams(logprobs=21), "logprobs", "max_logprobs"),
        (SamplingParams(prompt_logprobs=1000), "prompt_logprobs", "1000"),
        (SamplingParams(structured_outputs={"choice": ["y" * 70000]}), "structured_outputs",
         "max_grammar_chars"),
    ],
)
def test_over_a_limit_names_the_field(params, param, match):
    with pytest.raises(RequestLimitError, match=match) as e:
        check_request(params, LIMITS)
    assert e.value.param == param
    assert param in str(e.value)


def test_limits_are_settings():
    tight = RequestLimits(max_stop=1, max_request_work=4)
    with pytest.raises(RequestLimitError, match="max_stop"):
        check_request(SamplingParams(stop=["a", "b"]), tight)
    with pytest.raises(RequestLimitError, match="max_request_work"):
        check_request(SamplingParams(n=1, best_of=5, temperature=1.0), tight)


def test_chat_template_opt_in_and_length():
    check_chat_template(None, LIMITS)
    with pytest.raises(RequestLimitError, match="--trust-request-chat-template") as e:
        check_chat_template("{{ messages }}", LIMITS)
    assert e.value.param == "chat_template"
    trusting = RequestLimits(trust_request_chat_template=True, max_chat_template_chars=100)
    check_chat_template("{{ messages }}", trusting)
    with pytest.raises(RequestLimitError, match="101 characters"):
        check_chat_template("x" * 101, trusting)
