"""``LLM(...)``'s vLLM arguments: none is accepted and silently ignored (``quantization`` is an
engine option: ``tests/engine/quant/test_quant_refusals.py``)."""

from __future__ import annotations

import warnings

import pytest

from loramux.engine.llm import check_vllm_arguments


def test_vllm_defaults_pass_silently():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_vllm_arguments({"swap_space": 4,
                              "trust_remote_code": False, "tokenizer_mode": "auto"})


@pytest.mark.parametrize("options, why", [
    (dict(tensor_parallel_size=0), "tensor_parallel_size must be in"),
    (dict(distributed_executor_backend="ray"), "distributed_executor_backend must be 'mp'"),
])
def test_bad_parallel_options_are_refused_naming_them(options, why):
    from loramux.engine.config import EngineConfig

    with pytest.raises(ValueError, match=why):
        EngineConfig.from_options(**options)


@pytest.mark.parametrize("name, value", [("swap_space", 16), ("trust_remote_code", True),
                                         ("revision", "main"), ("download_dir", "/tmp/x"),
                                         ("tokenizer_mode", "slow"), ("disable_log_stats", True)])
def test_a_value_without_effect_warns_naming_it(name, value):
    with pytest.warns(UserWarning, match=f"{name}={value!r} has no effect"):
        check_vllm_arguments({name: value})


def test_unknown_arguments_are_a_type_error():
    with pytest.raises(TypeError, match="unexpected keyword arguments: \\['max_lora_ranks'\\]"):
        check_vllm_arguments({"max_lora_ranks": 8})
