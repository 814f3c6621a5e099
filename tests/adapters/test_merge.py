"""merge_and_unload export: the merged folder reproduces PEFT's base + adapter logits."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from loramux.adapters.format import AdapterValidationError
from loramux.adapters.merge import MergeCheckError, check_merged, export_merged

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "adapters" / "sql-lora"


def test_export_tiny(tiny_model_dir, peft_adapter, tmp_path):
    out = export_merged(
        tiny_model_dir, peft_adapter, tmp_path / "merged", check=True, progress=False
    )
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer_config.json"} <= names
    assert "adapter_config.json" not in names
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".merged")]
    result = check_merged(tiny_model_dir, peft_adapter, out)
    assert result.ok and result.max_abs_diff <= 1e-5
    with pytest.raises(FileExistsError):
        export_merged(tiny_model_dir, peft_adapter, out, progress=False)
    export_merged(tiny_model_dir, peft_adapter, out, overwrite=True, progress=False)


def test_check_detects_a_wrong_merge(tiny_model_dir, peft_adapter, tmp_path):
    from transformers import AutoModelForCausalLM

    out = export_merged(tiny_model_dir, peft_adapter, tmp_path / "merged", progress=False)
    plain = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    plain.save_pretrained(out)  # the base without the adapter
    result = check_merged(tiny_model_dir, peft_adapter, out)
    assert not result.ok and result.max_abs_diff > 1e-3
    with pytest.raises(MergeCheckError):
        # a tolerance no float computation meets
        export_merged(
            tiny_model_dir, peft_adapter, tmp_path / "m2", check=True, atol=-1.0, progress=False
        )


def test_export_refuses_bad_adapter(tiny_model_dir, adapter_copy, tmp_path):
    (adapter_copy / "adapter_config.json").write_text(
        '{"peft_type": "LORA", "r": 4, "lora_bias": true}'
    )
    with pytest.raises(AdapterValidationError, match="lora_bias"):
        export_merged(tiny_model_dir, adapter_copy, tmp_path / "merged", progress=False)
    assert not (tmp_path / "merged").exists()


@pytest.mark.e2e
def test_example_adapter_export_matches_peft(default_model_dir, tmp_path):
    """Merged-model logits equal PEFT base + adapter logits (float32, abs 1e-4)."""
    out = export_merged(default_model_dir, EXAMPLE, tmp_path / "sql-merged", progress=False)
    result = check_merged(default_model_dir, EXAMPLE, out, atol=1e-4)
    assert result.ok, f"max |Δlogit| per prompt: {result.per_prompt}"


@pytest.mark.e2e
def test_example_adapter_answers_in_sql(default_model_dir):
    """The shipped adapter answers in SQL where the base model does not."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_model_dir)
    base = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, EXAMPLE).eval()
    for question in ("How many employees work in the Engineering department?",
                     "List all customers from Italy."):  # fmt: skip
        text = tok.apply_chat_template(
            [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
        )
        ids = tok(text, return_tensors="pt", add_special_tokens=False)
        with torch.no_grad():
            tuned = model.generate(**ids, max_new_tokens=24, do_sample=False)
            with model.disable_adapter():
                plain = model.generate(**ids, max_new_tokens=24, do_sample=False)
        n = ids["input_ids"].shape[1]
        tuned_text = tok.decode(tuned[0, n:], skip_special_tokens=True).strip()
        plain_text = tok.decode(plain[0, n:], skip_special_tokens=True).strip()
        assert tuned_text.upper().startswith("SELECT"), tuned_text
        assert not plain_text.upper().startswith("SELECT"), plain_text


def test_export_merges_modules_to_save(tiny_model_dir, tmp_path):
    """``modules_to_save`` copies (every norm, the untied lm_head) merge as PEFT merges them: the
    merged model is PEFT's base + adapter (``check=True`` compares the logits)."""
    from safetensors.torch import load_file, save_file
    from support.lora_fixtures import make_peft_adapter

    a = make_peft_adapter(tiny_model_dir, tmp_path / "a", target_modules=["q_proj"],
                          modules_to_save=["norm"])
    sd = load_file(a / "adapter_model.safetensors")
    for k in sd:
        if k.endswith("norm.weight"):
            sd[k] += 0.25
    save_file(sd, str(a / "adapter_model.safetensors"), metadata={"format": "pt"})
    out = export_merged(tiny_model_dir, a, tmp_path / "merged", check=True, progress=False)
    merged = load_file(next(out.glob("*.safetensors")))
    base = load_file(next(tiny_model_dir.glob("*.safetensors")))
    assert torch.allclose(merged["model.norm.weight"], base["model.norm.weight"] + 0.25)
