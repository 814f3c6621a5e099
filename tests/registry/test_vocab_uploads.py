"""Uploads with vocabulary parts (``adapters/vocab.py``): trainable tokens stored with their kind
and their ids in the stored config; bad trainable tokens, embedding LoRA and lm_head LoRA (ids
outside the vocabulary, wrong shapes, non-finite values, full copies of the embedding that cannot
be compared, added tokens beyond the vocabulary) refused naming the field, nothing stored."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_upload_corpus import assert_nothing_stored

from loramux.adapters.errors import AdapterValidationError

VOCAB = 32000  # the tiny config's (transformers' Llama default)
P = "base_model.model."


def _with(path, config: dict, tensors: dict):
    """``path``'s adapter with ``config`` fields and ``tensors`` added."""
    cfg = json.loads((path / "adapter_config.json").read_text())
    cfg.update(config)
    (path / "adapter_config.json").write_text(json.dumps(cfg))
    sd = load_file(path / "adapter_model.safetensors")
    sd.update(tensors)
    save_file(sd, str(path / "adapter_model.safetensors"))
    return path


def _tokens(ids, rows=None):
    rows = torch.randn(len(ids), 64) * 0.1 if rows is None else rows
    return {"trainable_token_indices": ids}, {f"{P}model.embed_tokens.token_adapter.trainable_tokens_delta": rows}


def test_trainable_tokens_stored_with_their_kind(registry, make_adapter):
    registry.create_tenant("acme")
    handle = registry.upload("acme", "tok", _with(make_adapter(), *_tokens([5, 7, 31999])))
    assert handle.kind == "LoRA+tokens"
    assert handle.config["trainable_token_indices"] == {"embed_tokens": [5, 7, 31999]}
    assert handle.to_dict()["kind"] == "LoRA+tokens"


def _bad_cases():
    nan = torch.full((2, 64), float("nan"))
    lm_a, lm_b = f"{P}lm_head.lora_A.weight", f"{P}lm_head.lora_B.weight"
    emb_a, emb_b = f"{P}model.embed_tokens.lora_embedding_A", f"{P}model.embed_tokens.lora_embedding_B"
    tok = f"{P}model.embed_tokens.token_adapter.trainable_tokens_delta"
    return {
        "id outside the vocabulary": (*_tokens([5, VOCAB]), "trainable_token_indices",
                                      f"token id {VOCAB} is outside"),
        "repeated ids": (*_tokens([5, 5]), "trainable_token_indices", "repeat"),
        "rows of the wrong shape": ({"trainable_token_indices": [5, 6]}, {tok: torch.zeros(3, 64)}, tok,
                                    "shape"),
        "non-finite rows": (*_tokens([5, 6], nan), tok, "NaN"),
        "rows missing": ({"trainable_token_indices": [5, 6]}, {}, "embed_tokens.token_adapter", "missing"),
        "rows undeclared": ({}, {tok: torch.zeros(2, 64)}, tok, "declares no trainable tokens"),
        "lm_head B of the wrong shape": ({"target_modules": ["q_proj", "v_proj", "lm_head"]},
                                         {lm_a: torch.zeros(4, 64), lm_b: torch.zeros(100, 4)}, lm_b, "shape"),
        "embedding A of the wrong shape": ({"target_modules": ["q_proj", "v_proj", "embed_tokens"]},
                                           {emb_a: torch.zeros(4, 100), emb_b: torch.zeros(64, 4)}, emb_a, "shape"),
        "embedding LoRA undeclared": ({}, {emb_a: torch.zeros(4, 100), emb_b: torch.zeros(64, 4)}, emb_a,
                                      "declares no a LoRA"),
        "integer rows": ({"trainable_token_indices": [5]}, {tok: torch.zeros(1, 64, dtype=torch.int32)}, tok,
                         "dtype"),
    }


@pytest.mark.parametrize("case", list(_bad_cases()))
def test_bad_vocabulary_parts_refused_and_nothing_stored(registry, make_adapter, tmp_path, case):
    config, tensors, field, match = _bad_cases()[case]
    registry.create_tenant("acme")
    with pytest.raises(AdapterValidationError, match=match) as e:
        registry.upload("acme", "bad", _with(make_adapter(), config, tensors))
    assert field in e.value.field
    assert_nothing_stored(registry, tmp_path)


def test_added_tokens_beyond_the_vocabulary_refused(registry, make_adapter, tmp_path):
    registry.create_tenant("acme")
    path = make_adapter()
    (path / "added_tokens.json").write_text(json.dumps({"<|tool|>": VOCAB}))
    with pytest.raises(AdapterValidationError, match="beyond the base model's vocabulary") as e:
        registry.validate(path)
    assert e.value.field == "added_tokens.json"


def test_equal_base_copies_are_not_stored(tmp_path, default_model_dir):
    """Served from a base folder, PEFT's full copies of the embedding layers equal to the base's
    are dropped at upload (the stored weights hold the LoRA alone), different ones refused."""
    from support.lora_fixtures import make_peft_adapter
    from support.tiny_models import make_tiny_llama

    from loramux.registry import build_registry

    base = make_tiny_llama(tmp_path / "base", default_model_dir, tie_word_embeddings=False)
    service = build_registry(database_url=f"sqlite:///{tmp_path / 'r.db'}", data_dir=tmp_path / "data",
                             base_model=str(base), max_lora_rank=16, auto_upgrade=True)
    try:
        service.create_tenant("acme")
        a = make_peft_adapter(base, tmp_path / "a", target_modules=["embed_tokens", "lm_head", "q_proj"])
        handle = service.upload("acme", "emb", a)
        assert handle.kind == "LoRA+embedding"
        stored = load_file(handle.local_path() / "adapter_model.safetensors")
        assert not [k for k in stored if k.endswith("base_layer.weight")]
        assert f"{P}lm_head.lora_B.weight" in stored

        def nudge(sd):
            sd[f"{P}model.embed_tokens.base_layer.weight"][0, 0] += 1

        sd = load_file(a / "adapter_model.safetensors")
        nudge(sd)
        save_file(sd, str(a / "adapter_model.safetensors"))
        with pytest.raises(AdapterValidationError, match="differ from the served base.*quota of 0") as e:
            service.upload("acme", "emb2", a)  # max_embedding_copy_bytes: 0 by default
        assert e.value.field == f"{P}model.embed_tokens.base_layer.weight"
    finally:
        service.db.dispose()
