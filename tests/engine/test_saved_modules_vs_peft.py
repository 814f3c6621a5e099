"""PEFT's ``modules_to_save`` and full copies of the embedding layers (``adapters/saved_modules.py``,
``adapters/full_copies.py``, ``engine/lora/norms.py``) against PEFT (float32, teacher-forced), in
one mixed batch with base rows and a plain LoRA: every norm (``["norm"]`` matches them all by
suffix), ``embed_tokens`` and ``lm_head`` copies, and a ``save_embedding_layers`` copy that
differs from the base (PEFT loads it into the base layer: on a tied base the logits change too).
Each adapter without its copies gives other numbers, so the check can tell."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from support.lora_fixtures import make_peft_adapter, peft_reference, teacher_forcing_gaps
from support.peft_harness import check_rows_match_peft, peft_prompts
from support.tiny_models import make_tiny_llama, make_tiny_model

from loramux.engine import LLM, LoRARequest, SamplingParams

WEIGHTS = "adapter_model.safetensors"


def _nudge(adapter, match, rows=None, seed=0, std=0.3):
    """Add noise to the saved copies whose key contains ``match`` (only ``rows`` of 2-D ones)."""
    sd = load_file(adapter / WEIGHTS)
    g = torch.Generator().manual_seed(seed)
    hit = [k for k in sd if match in k and "lora_" not in k]
    assert hit, match
    for k in hit:
        t = sd[k]
        if t.dim() == 1:
            t += torch.randn(t.shape, generator=g) * std
        else:
            t[rows] += torch.randn(t[rows].shape, generator=g) * std
    save_file(sd, str(adapter / WEIGHTS), metadata={"format": "pt"})
    return hit


def _without_copies(adapter, out):
    """``adapter`` without its modules_to_save / base_layer copies (PEFT then keeps the base's)."""
    shutil.copytree(adapter, out)
    sd = {k: v for k, v in load_file(adapter / WEIGHTS).items() if "lora_" in k}
    save_file(sd, str(out / WEIGHTS), metadata={"format": "pt"})
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    cfg["modules_to_save"] = None
    (out / "adapter_config.json").write_text(json.dumps(cfg))
    return out


@pytest.fixture(scope="module")
def prompts(default_model_dir):
    return peft_prompts(default_model_dir, 20)


@pytest.mark.parametrize("family", ["llama-tied", "llama", "qwen3", "gemma3"])
def test_saved_modules_in_a_mixed_batch_match_peft(family, tmp_path, default_model_dir, prompts):
    """Llama tied and untied; Qwen 3 (q/k norms); Gemma 3 (sandwich norms, a unit offset)."""
    if family.startswith("llama"):
        base = make_tiny_llama(tmp_path / "base", default_model_dir, tie_word_embeddings=family == "llama-tied")
    else:
        base = make_tiny_model(tmp_path / "base", default_model_dir, family)
    tied = json.loads((base / "config.json").read_text()).get("tie_word_embeddings", True)
    ids = sorted({p[j] for p in prompts for j in (1, 2)})  # tokens of every prompt
    specs = [("norms", dict(target_modules=["q_proj"], modules_to_save=["norm"])),
             ("embed", dict(target_modules=["v_proj"], modules_to_save=["embed_tokens"])),
             ("head", dict(target_modules=["o_proj"], modules_to_save=["lm_head"])),
             ("copy", dict(target_modules=["embed_tokens", "q_proj"], save_embedding_layers=True)),
             ("plain", dict(target_modules=["q_proj", "v_proj"]))]
    adapters = []
    for i, (name, extra) in enumerate(specs):
        save_layers = extra.pop("save_embedding_layers", None)
        a = make_peft_adapter(base, tmp_path / name, r=4, seed=i, std=0.1, **extra)
        if save_layers:
            assert "embed_tokens.base_layer.weight" in str(list(load_file(a / WEIGHTS)))
        adapters.append(a)
    normed = _nudge(adapters[0], "norm.weight", seed=1)
    assert len(normed) >= 3  # every layer's norms and the final one, matched by suffix
    _nudge(adapters[1], "embed_tokens.weight", ids, seed=2)
    head_rows = sorted({*ids, 42, 1000})
    _nudge(adapters[2], "lm_head.weight", head_rows, seed=3, std=1.0)
    _nudge(adapters[3], "embed_tokens.base_layer.weight", ids, seed=4)
    llm = LLM(str(base), dtype="float32", device="cpu", max_model_len=128, enable_lora=True,
              max_loras=len(adapters), max_lora_rank=8, max_num_batched_tokens=96)
    rows = prompts + prompts[:4]
    choice = [0, 1, 2, 3, 4, None, 3, 2, 1, 0]
    loras = [None if c is None else LoRARequest(specs[c][0], c + 1, str(adapters[c])) for c in choice]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)
    outs = llm.generate([{"prompt_token_ids": p} for p in rows], params, lora_request=loras)
    refs: dict = {}
    check_rows_match_peft(base, adapters, rows, choice, outs, refs=refs, against_base=False)
    for c in range(4):  # without its copies each would give other numbers: the check tells
        i = choice.index(c)
        plain = peft_reference(base, _without_copies(adapters[c], tmp_path / f"plain{c}"))
        toks = outs[i].outputs[0].token_ids
        _, want = teacher_forcing_gaps(refs[c], rows[i], toks)
        _, without = teacher_forcing_gaps(plain, rows[i], toks)
        assert (want - without).abs().max() > 1e-3, (specs[c][0], tied)


def test_saved_module_refusals(tmp_path, default_model_dir):
    """A module that is neither a norm nor an embedding layer is refused naming it; a resized
    copy is refused naming its shape; a copy's rows past the quota name the quota."""
    from loramux.adapters.errors import AdapterValidationError
    from loramux.adapters.format import validate_adapter

    base = make_tiny_llama(tmp_path / "base", default_model_dir, tie_word_embeddings=False)
    cfg = json.loads((base / "config.json").read_text())
    a = make_peft_adapter(base, tmp_path / "a", target_modules=["q_proj"], modules_to_save=["v_proj"])
    with pytest.raises(AdapterValidationError, match="'model.layers.0.self_attn.v_proj' is not served"):
        validate_adapter(a, cfg, base_folder=base)
    b = make_peft_adapter(base, tmp_path / "b", target_modules=["q_proj"], modules_to_save=["lm_head"])
    _nudge(b, "lm_head.weight", [3, 4, 5], seed=1)
    w = validate_adapter(b, cfg, base_folder=base)
    assert w.vocab_rows["lm_head"][0].tolist() == [3, 4, 5] and w.spec.kind == "LoRA+modules"
    hidden = cfg["hidden_size"]
    with pytest.raises(AdapterValidationError, match=f"{3 * hidden * 4} bytes.*quota of {2 * hidden * 4}"):
        validate_adapter(b, cfg, base_folder=base, max_copy_bytes=2 * hidden * 4)
    sd = load_file(b / WEIGHTS)
    sd["base_model.model.lm_head.weight"] = torch.cat([sd["base_model.model.lm_head.weight"]] * 2)
    save_file(sd, str(b / WEIGHTS), metadata={"format": "pt"})
    with pytest.raises(AdapterValidationError, match="shape"):
        validate_adapter(b, cfg, base_folder=base)
    n = make_peft_adapter(base, tmp_path / "n", target_modules=["q_proj"], modules_to_save=["norm"])
    sd = load_file(n / WEIGHTS)
    sd["base_model.model.model.norm.weight"] = torch.ones(cfg["hidden_size"] + 1)
    save_file(sd, str(n / WEIGHTS), metadata={"format": "pt"})
    with pytest.raises(AdapterValidationError, match="model.norm.weight: shape"):
        validate_adapter(n, cfg, base_folder=base)
