"""The vocabulary parts of the format (``adapters/vocab.py``): PEFT's full copies of the
embedding layers compared with the base (equal: dropped; different: refused), non-finite and
overflowing parts refused naming them, a save round trip, and the export of what PEFT can merge."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from support.lora_fixtures import make_peft_adapter
from support.tiny_models import make_tiny_llama

from loramux.adapters.errors import AdapterValidationError
from loramux.adapters.format import load_adapter, validate_adapter
from loramux.adapters.merge import export_merged
from loramux.adapters.weights import save_adapter

EMB = "base_model.model.model.embed_tokens."
HEAD = "base_model.model.lm_head."


@pytest.fixture(scope="module")
def bases(tmp_path_factory, default_model_dir):
    root = tmp_path_factory.mktemp("vocab-bases")
    return {tied: make_tiny_llama(root / str(tied), default_model_dir, tie_word_embeddings=tied)
            for tied in (True, False)}


def _config(base):
    return json.loads((base / "config.json").read_text())


def _edit(path, fn):
    sd = load_file(path / "adapter_model.safetensors")
    fn(sd)
    save_file(sd, str(path / "adapter_model.safetensors"))
    return path


def test_equal_base_copies_dropped_and_different_rows_kept_under_the_quota(bases, tmp_path):
    base = bases[False]
    a = make_peft_adapter(base, tmp_path / "a", target_modules=["embed_tokens", "lm_head", "q_proj"])
    assert f"{EMB}base_layer.weight" in load_file(a / "adapter_model.safetensors")
    w = validate_adapter(a, _config(base), base_model_name=str(base))
    assert sum("equal to it: not stored" in n for n in w.warnings) == 2
    assert set(w.vocab_lora) == {"embed_tokens", "lm_head"}
    assert w.spec.kind == "LoRA+embedding"
    with pytest.raises(AdapterValidationError, match="cannot be compared") as e:
        validate_adapter(a, _config(base), base_model_name="someone/else")
    assert e.value.field == f"{EMB}base_layer.weight"

    def nudge(sd):
        sd[f"{HEAD}base_layer.weight"][3, 3] += 1.0

    _edit(a, nudge)
    w = validate_adapter(a, _config(base), base_model_name=str(base))
    ids, rows = w.vocab_rows["lm_head"]
    assert ids.tolist() == [3] and rows.shape == (1, w.vocab_lora["lm_head"][0].shape[1])
    assert w.full_copies == (f"{HEAD}base_layer.weight",) and "embed_tokens" not in w.vocab_rows
    with pytest.raises(AdapterValidationError, match="max_embedding_copy_bytes quota of 8") as e:
        validate_adapter(a, _config(base), base_model_name=str(base), max_copy_bytes=8)
    assert e.value.field == f"{HEAD}base_layer.weight"


@pytest.mark.parametrize("key, value, match", [
    (f"{EMB}lora_embedding_B", float("nan"), "NaN or infinite"),
    (f"{HEAD}lora_B.weight", 1e30, "overflows"),
    (f"{EMB}lora_embedding_A", 1e30, "overflows"),
])
def test_bad_embedding_and_head_lora_refused(bases, tmp_path, key, value, match):
    base = bases[False]
    a = make_peft_adapter(base, tmp_path / "a", target_modules=["embed_tokens", "lm_head", "q_proj"])

    def spoil(sd):
        sd[key][0, 0] = value

    _edit(a, spoil)
    with pytest.raises(AdapterValidationError, match=match) as e:
        validate_adapter(a, _config(base), base_model_name=str(base), serving_dtype=torch.float32)
    assert e.value.field in (key, "weights")
    assert "embed_tokens" in str(e.value) or "lm_head" in str(e.value)


def test_save_round_trip_keeps_the_vocabulary_parts(bases, tmp_path):
    base = bases[True]
    a = make_peft_adapter(base, tmp_path / "a", target_modules=["q_proj"], trainable_token_indices=[3, 9])
    w = load_adapter(a)
    again = load_adapter(save_adapter(w, tmp_path / "b"))
    assert again.spec.trainable_tokens == (("embed_tokens", (3, 9)),)
    assert torch.equal(again.vocab_tokens["embed_tokens"][1], w.vocab_tokens["embed_tokens"][1])
    assert again.num_bytes() == w.num_bytes()


@pytest.mark.parametrize("tied, extra", [
    (True, dict(target_modules=["q_proj"], trainable_token_indices=[3, 9, 200])),
    (False, dict(target_modules=["q_proj"], trainable_token_indices={"embed_tokens": [3, 9]})),
    (False, dict(target_modules=["embed_tokens", "lm_head", "v_proj"])),
    (True, dict(target_modules=["embed_tokens", "v_proj"], ensure_weight_tying=True)),
], ids=["tokens-tied", "tokens-untied", "embed-head", "embed-tied"])
def test_export_merges_what_peft_can(bases, tmp_path, tied, extra):
    base = bases[tied]
    a = make_peft_adapter(base, tmp_path / "a", std=0.1, **extra)
    if tied and "embed_tokens" in extra["target_modules"]:
        with pytest.raises(AdapterValidationError, match="ties its embeddings") as e:
            export_merged(base, a, tmp_path / "merged", check=True, progress=False)
        assert e.value.field == "target_modules"
        return
    out = export_merged(base, a, tmp_path / "merged", check=True, progress=False)
    assert (out / "config.json").is_file()


def test_added_tokens_must_be_the_bases(bases, tmp_path, default_model_dir):
    """A copy of the base's tokenizer passes; an added token beyond the vocabulary, or on an id
    the base's tokenizer gives another token, is refused naming the file (the engine would serve
    it with the base's tokenizer)."""
    import shutil

    base = bases[True]
    a = make_peft_adapter(base, tmp_path / "a", target_modules=["q_proj"])
    shutil.copy(base / "tokenizer.json", a / "tokenizer.json")
    validate_adapter(a, _config(base), base_model_name=str(base))
    for tokens, match in [({"<|new|>": _config(base)["vocab_size"]}, "beyond the base model's vocabulary"),
                          ({"<|new|>": 5}, "another token of the base"),
                          ({"<|im_start|>": 7}, "where the base model's tokenizer has")]:
        (a / "added_tokens.json").write_text(json.dumps(tokens))
        with pytest.raises(AdapterValidationError, match=match) as e:
            validate_adapter(a, _config(base), base_model_name=str(base))
        assert e.value.field == "added_tokens.json"
    (a / "added_tokens.json").unlink()
    cfg = {"added_tokens_decoder": {"9": {"content": "<|new|>", "special": True}}}
    (a / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(AdapterValidationError, match="another token of the base") as e:
        validate_adapter(a, _config(base), base_model_name=str(base))
    assert e.value.field == "tokenizer_config.json"
