"""SamplingParams validation: every bad value raises ValueError naming the parameter."""

from __future__ import annotations

import logging

import pytest

from loramux.engine.sampling_params import SamplingParams

# (keyword arguments, the parameter name the error must mention)
INVALID = [
    ({"n": 0}, "n"),
    ({"n": -3}, "n"),
    ({"n": 3, "best_of": 2}, "best_of"),
    ({"n": 1, "best_of": 3, "temperature": 0.0}, "best_of"),
    ({"presence_penalty": 2.01}, "presence_penalty"),
    ({"presence_penalty": -2.5}, "presence_penalty"),
    ({"frequency_penalty": 2.5}, "frequency_penalty"),
    ({"frequency_penalty": -2.01}, "frequency_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"repetition_penalty": -1.0}, "repetition_penalty"),
    ({"temperature": -0.1}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.01}, "top_p"),
    ({"top_p": -0.5}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"min_p": -0.01}, "min_p"),
    ({"min_p": 1.5}, "min_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": -1}, "max_tokens"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
    ({"logprobs": -1}, "logprobs"),
    ({"prompt_logprobs": -1}, "prompt_logprobs"),
    ({"stop": ""}, "stop"),
    ({"stop": ["ok", ""]}, "stop"),
    ({"stop": ["ok", 3]}, "stop"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"logit_bias": {5: 100.5}}, "logit_bias"),
    ({"logit_bias": {5: -101}}, "logit_bias"),
    ({"logit_bias": {-1: 1.0}}, "logit_bias"),
    ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"allowed_token_ids": [3, -1]}, "allowed_token_ids"),
    # bad types
    ({"n": 1.5}, "n"),
    ({"n": True}, "n"),
    ({"best_of": "2"}, "best_of"),
    ({"top_k": 2.0}, "top_k"),
    ({"top_p": "0.9"}, "top_p"),
    ({"temperature": None}, "temperature"),
    ({"temperature": "hot"}, "temperature"),
    ({"stop": 5}, "stop"),
    ({"stop_token_ids": 5}, "stop_token_ids"),
    ({"allowed_token_ids": 5}, "allowed_token_ids"),
    ({"logit_bias": [1, 2]}, "logit_bias"),
    ({"logit_bias": {"a": 1.0}}, "logit_bias"),
    ({"logit_bias": {1: "x"}}, "logit_bias"),
    ({"logit_bias": {1: float("nan")}}, "logit_bias"),
    ({"temperature": float("nan")}, "temperature"),
    ({"presence_penalty": "high"}, "presence_penalty"),
    ({"repetition_penalty": True}, "repetition_penalty"),
    ({"min_p": float("nan")}, "min_p"),
    ({"max_tokens": 2.0}, "max_tokens"),
    ({"min_tokens": "1"}, "min_tokens"),
    ({"logprobs": 1.0}, "logprobs"),
    ({"seed": 1.5}, "seed"),
    ({"seed": "42"}, "seed"),
    ({"stop_token_ids": [1.0]}, "stop_token_ids"),
    ({"allowed_token_ids": ["a"]}, "allowed_token_ids"),
]


@pytest.mark.parametrize(("kwargs", "name"), INVALID, ids=[f"{n}-{kw}" for kw, n in INVALID])
def test_invalid_value_raises_value_error_naming_the_parameter(kwargs, name):
    with pytest.raises(ValueError) as err:
        SamplingParams(**kwargs)
    message = str(err.value)
    # the parameter is named as a word (not e.g. "n" matched inside "must")
    assert f"{name} " in message or message.startswith(name), message


def test_error_mentions_allowed_range():
    with pytest.raises(ValueError, match=r"\[-2, 2\]"):
        SamplingParams(presence_penalty=3)
    with pytest.raises(ValueError, match=r"\(0, 1\]"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match=r"\[-100, 100\]"):
        SamplingParams(logit_bias={1: 200})


@pytest.mark.parametrize(
    "kwargs",
    [
        {"top_k": -1},
        {"top_k": 0},
        {"top_k": 1},
        {"top_p": 1.0},
        {"top_p": 1e-3},
        {"temperature": 0.0},
        {"temperature": 2.0},
        {"min_p": 0.0},
        {"min_p": 1.0},
        {"presence_penalty": -2.0, "frequency_penalty": 2.0},
        {"repetition_penalty": 1e-3},
        {"max_tokens": 1},
        {"max_tokens": None},
        {"min_tokens": 4, "max_tokens": 4},
        {"min_tokens": 100, "max_tokens": None},
        {"logprobs": 0},
        {"logprobs": 20},
        {"stop": "x"},
        {"stop": ["x", "yy"]},
        {"stop_token_ids": [0, 5]},
        {"logit_bias": {3: 100, 4: -100}},
        {"allowed_token_ids": [0]},
        {"n": 2, "best_of": 2, "temperature": 0.0},
        {"n": 2, "best_of": 4, "temperature": 0.8},
        {"seed": 0},
    ],
)
def test_valid_edge_values_are_accepted(kwargs):
    SamplingParams(**kwargs)


def test_defaults_and_normalization():
    p = SamplingParams()
    assert (p.n, p.best_of, p.temperature, p.top_p, p.top_k, p.max_tokens) == (1, 1, 1.0, 1.0, 0, 16)
    assert not p.is_greedy
    assert SamplingParams(temperature=0).is_greedy
    assert SamplingParams(top_k=-1).top_k == 0  # -1 normalized to "off"
    assert SamplingParams(n=3, temperature=1.0).best_of == 3
    assert SamplingParams(stop="END").stop_strings == ["END"]
    assert SamplingParams(stop=["a", "b"]).stop_strings == ["a", "b"]
    assert SamplingParams().stop_strings == []
    assert SamplingParams(stop_token_ids=None).stop_token_ids == []
    # string keys (JSON) become ints, values floats
    assert SamplingParams(logit_bias={"7": 3}).logit_bias == {7: 3.0}


def test_tiny_temperature_is_raised_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="loramux.engine.sampling_params"):
        p = SamplingParams(temperature=1e-4)
    assert p.temperature == pytest.approx(1e-2)
    assert not p.is_greedy
    assert any("temperature" in r.getMessage() for r in caplog.records)


def test_verify_vocab():
    SamplingParams(stop_token_ids=[9], logit_bias={9: 1.0}, allowed_token_ids=[0, 9]).verify_vocab(10)
    for kwargs, name in (
        ({"stop_token_ids": [3, 10]}, "stop_token_ids"),
        ({"logit_bias": {10: 1.0}}, "logit_bias"),
        ({"allowed_token_ids": [1, 12]}, "allowed_token_ids"),
    ):
        p = SamplingParams(**kwargs)
        with pytest.raises(ValueError, match=name) as err:
            p.verify_vocab(10)
        assert "size 10" in str(err.value)


def test_clone_revalidates_and_keeps_fields():
    p = SamplingParams(temperature=0.7, top_k=-1, stop="x", seed=3, logit_bias={1: 2.0})
    q = p.clone(max_tokens=5)
    assert q.max_tokens == 5
    assert (q.temperature, q.top_k, q.stop_strings, q.seed, q.logit_bias) == (0.7, 0, ["x"], 3, {1: 2.0})
    assert p.max_tokens == 16
    with pytest.raises(ValueError, match="top_p"):
        p.clone(top_p=0)
