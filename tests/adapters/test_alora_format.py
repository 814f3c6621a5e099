"""Activated LoRA (``alora_invocation_tokens``) in the adapter format: parsed and kept, its kind
``aLoRA``; bad values refused naming the field; an aLoRA is never merged (export refuses it
naming the field, which the API answers with 422); where it starts in a prompt as PEFT's
``calculate_alora_offsets`` finds it."""

from __future__ import annotations

import json

import pytest
import torch
from support.lora_fixtures import make_peft_adapter

from loramux.adapters.alora import MAX_INVOCATION_TOKENS, activation_start, parse_invocation
from loramux.adapters.errors import AdapterValidationError
from loramux.adapters.spec import parse_config

BASE = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}


def test_invocation_parsed_kept_and_written_back():
    spec = parse_config({**BASE, "alora_invocation_tokens": [5, 6, 7]})
    assert spec.alora_invocation_tokens == (5, 6, 7)
    assert spec.kind == "aLoRA"
    assert spec.to_config()["alora_invocation_tokens"] == [5, 6, 7]
    plain = parse_config(BASE)
    assert plain.alora_invocation_tokens is None and plain.kind == "LoRA"
    assert "alora_invocation_tokens" not in plain.to_config()
    assert parse_config({**BASE, "alora_invocation_tokens": None}).kind == "LoRA"


@pytest.mark.parametrize("value, match", [
    ([], "non-empty list"),
    ("<|assistant|>", "non-empty list"),
    ({"a": 1}, "non-empty list"),
    ([1, "2"], "non-negative integers"),
    ([1, True], "non-negative integers"),
    ([1, -3], "non-negative integers"),
    ([1.5], "non-negative integers"),
    (list(range(MAX_INVOCATION_TOKENS + 1)), "above the limit"),
])
def test_bad_invocation_refused_naming_the_field(value, match):
    with pytest.raises(AdapterValidationError, match=f"alora_invocation_tokens: .*{match}") as e:
        parse_config({**BASE, "alora_invocation_tokens": value})
    assert e.value.field == "alora_invocation_tokens"


def test_invocation_outside_the_vocabulary_refused():
    with pytest.raises(AdapterValidationError, match="outside the base model's vocabulary of 100") as e:
        parse_invocation({"alora_invocation_tokens": [3, 100]}, vocab_size=100)
    assert e.value.field == "alora_invocation_tokens"
    assert parse_invocation({"alora_invocation_tokens": [3, 99]}, vocab_size=100) == (3, 99)


def test_dora_and_expert_alora_refused():
    """PEFT has no (aLoRA, DoRA) variant: ``resolve_lora_variant`` raises on it."""
    with pytest.raises(AdapterValidationError, match="use_dora") as e:
        parse_config({**BASE, "alora_invocation_tokens": [1], "use_dora": True})
    assert e.value.field == "alora_invocation_tokens"
    with pytest.raises(AdapterValidationError, match="target_parameters"):
        parse_invocation({"alora_invocation_tokens": [1], "target_parameters": ["mlp.experts.down_proj"]})


def test_peft_refuses_dora_alora_too(tiny_model_dir):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    cfg = LoraConfig(task_type="CAUSAL_LM", r=4, target_modules=["q_proj"], use_dora=True,
                     alora_invocation_tokens=[5])
    with pytest.raises(ValueError, match="unsupported variant combination"):
        get_peft_model(base, cfg)


def test_validated_against_the_base_vocabulary(tiny_model_dir, tmp_path):
    from loramux.adapters.format import validate_adapter

    vocab = json.loads((tiny_model_dir / "config.json").read_text())["vocab_size"]
    path = make_peft_adapter(tiny_model_dir, tmp_path / "a", alora_invocation_tokens=[7, 8])
    weights = validate_adapter(path, json.loads((tiny_model_dir / "config.json").read_text()))
    assert weights.spec.kind == "aLoRA" and weights.spec.alora_invocation_tokens == (7, 8)
    cfg = json.loads((path / "adapter_config.json").read_text())
    cfg["alora_invocation_tokens"] = [7, vocab]
    (path / "adapter_config.json").write_text(json.dumps(cfg))
    with pytest.raises(AdapterValidationError, match=f"token id {vocab} is outside") as e:
        validate_adapter(path, json.loads((tiny_model_dir / "config.json").read_text()))
    assert e.value.field == "alora_invocation_tokens"


def test_export_refuses_an_alora_naming_the_field(tiny_model_dir, tmp_path):
    from loramux.adapters.merge import export_merged
    from loramux.platform.error_handlers import error_table

    path = make_peft_adapter(tiny_model_dir, tmp_path / "a", alora_invocation_tokens=[7, 8])
    with pytest.raises(AdapterValidationError, match="cannot be merged") as e:
        export_merged(tiny_model_dir, path, tmp_path / "out", progress=False)
    assert e.value.field == "alora_invocation_tokens"
    assert not (tmp_path / "out").exists()
    assert error_table()[AdapterValidationError].status == 422


@pytest.mark.parametrize("prompt, invocation, start", [
    ([1, 2, 3, 4], [2, 3], 1),
    ([2, 3, 9, 2, 3, 5], [2, 3], 3),  # the last occurrence
    ([1, 2, 3], [2, 3], 1),  # at the very end
    ([1, 2, 4, 3], [2, 3], None),
    ([2], [2, 3], None),  # a prefix of it at the end is no occurrence
    ([5, 5, 5], [5, 5], 1),  # overlapping: the last start
    ([1, 2], None, 0),  # a plain LoRA
])
def test_activation_start_is_peft_offset(prompt, invocation, start):
    assert activation_start(prompt, invocation) == start
    if invocation is None:
        return
    from types import SimpleNamespace

    from peft.tuners.lora.variants import calculate_alora_offsets

    cfg = {"a": SimpleNamespace(alora_invocation_tokens=invocation)}
    (offset,) = calculate_alora_offsets(cfg, "a", torch.tensor([prompt]))
    assert offset == (None if start is None else len(prompt) - start)
