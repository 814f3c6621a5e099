"""The family seam: a family is one row (``adapters.families.register_family``) and one module.
This test adds one of its own — "Acme", Llama's layer under a new architecture name, whose
module (written to ``tmp_path`` and imported by its dotted name) builds the feed-forward block
itself from the layer pieces through the ``LayerContext`` — and serves it: the engine's
greedy tokens and logprobs equal transformers' (teacher forced, float32), a PEFT adapter of it
passes the upload checks and its rows equal PEFT's. The row is taken back after each test."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from support.greedy_reference import check_greedy
from support.lora_fixtures import make_peft_adapter, peft_reference, teacher_forcing_gaps
from support.tiny_models import make_tiny_llama

from loramux.adapters.arch import SUPPORTED_MODULES, model_types_named, resolve_architecture
from loramux.adapters.errors import AdapterValidationError
from loramux.adapters.families import (
    FAMILIES,
    Architecture,
    ModelFamily,
    register_family,
    unregister_family,
)
from loramux.adapters.format import validate_adapter
from loramux.engine import LLM, LoRARequest, SamplingParams
from loramux.engine.errors import ModelLoadError

MODULE = "loramux_test_acme_family"
ARCH = "AcmeForCausalLM"
MAX_TOKENS = 8
FAMILY_MODULE = '''
"""Acme: Llama's decoder layer, its gated MLP built here from the layer context."""
import torch

from loramux.engine.model.decoder import GatedMLP
from loramux.engine.model.linear import Linear
from loramux.engine.model.spec import DecoderSpec, LayerSpec, layer_windows

BUILT = []  # the layers whose MLP this module built


def gated_mlp(ctx):
    BUILT.append(ctx.index)
    p = ctx.prefix + "mlp."
    gate_up = torch.cat([ctx.take(p + "gate_proj.weight"), ctx.take(p + "up_proj.weight")])
    return GatedMLP(Linear(gate_up), Linear(ctx.take(p + "down_proj.weight")), ctx.activation)


def decoder_spec(config):
    return DecoderSpec(layers=tuple(LayerSpec(w) for w in layer_windows(config)),
                       activation=config.hidden_act, mlp=gated_mlp)
'''


def acme_row() -> ModelFamily:
    return ModelFamily("acme", "Acme", MODULE, (Architecture(ARCH, "llama"),), SUPPORTED_MODULES,
                       name_patterns=(("llama", r"acme"),))


@pytest.fixture
def acme(tmp_path, monkeypatch):
    """The Acme family registered (row + importable module) for one test, then removed."""
    src = tmp_path / "family_src"
    src.mkdir()
    (src / f"{MODULE}.py").write_text(FAMILY_MODULE)
    monkeypatch.syspath_prepend(str(src))
    family = register_family(acme_row())
    yield family
    unregister_family(family.name)
    sys.modules.pop(MODULE, None)


@pytest.fixture
def acme_base(tmp_path, default_model_dir):
    """A tiny random Llama saved with ``architectures: [AcmeForCausalLM]`` (transformers loads
    it by its ``model_type``, llama: the reference)."""
    path = make_tiny_llama(tmp_path / "acme-tiny", default_model_dir, num_hidden_layers=2)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "architectures": [ARCH]}))
    return path


def reference(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def prompts():
    return [[1, 450, 7483, 310, 3444], [1, 822, 18755, 29898, 29876, 1125, 13, 1678], [1, 15043]]


def test_a_family_added_in_the_test_serves_like_transformers(acme, acme_base):
    llm = LLM(str(acme_base), dtype="float32", device="cpu", max_model_len=64)
    assert llm.llm_engine.model.family is acme
    assert sys.modules[MODULE].BUILT == [0, 1]  # the family's own MLP code ran, per layer
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts()], params)
    ref = reference(acme_base)
    for prompt, out in zip(prompts(), outs, strict=True):
        comp = out.outputs[0]
        logits = check_greedy(ref, prompt, comp.token_ids)
        ref_lp = torch.log_softmax(logits.double(), dim=-1)
        for pos, (tok, entry) in enumerate(zip(comp.token_ids, comp.logprobs, strict=True)):
            assert entry[tok].logprob == pytest.approx(ref_lp[pos, tok].item(), abs=1e-4)
    assert len({tuple(o.outputs[0].token_ids) for o in outs}) > 1, "a degenerate model tests nothing"


def test_a_peft_adapter_of_the_added_family_validates_and_serves(acme, acme_base, tmp_path):
    targets = list(SUPPORTED_MODULES)
    adapter = make_peft_adapter(acme_base, tmp_path / "a", r=4, target_modules=targets, std=0.1)
    weights = validate_adapter(adapter, json.loads((acme_base / "config.json").read_text()))
    assert set(weights.layers[0]) == set(targets) and not weights.warnings
    llm = LLM(str(acme_base), dtype="float32", device="cpu", max_model_len=64, enable_lora=True,
              max_loras=1, max_lora_rank=8)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1)
    prompt = prompts()[1]
    out = llm.generate([{"prompt_token_ids": prompt}], params,
                       lora_request=LoRARequest("acme-lora", 1, str(adapter)))[0].outputs[0]
    gaps, ref_lp = teacher_forcing_gaps(peft_reference(acme_base, adapter), prompt, out.token_ids)
    assert max(gaps) <= 2e-3, gaps
    for j, (tok, entry) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
        assert entry[tok].logprob == pytest.approx(ref_lp[j, tok].item(), abs=1e-4)
    _, base_lp = teacher_forcing_gaps(peft_reference(acme_base, None), prompt, out.token_ids)
    assert (base_lp - ref_lp).abs().max() > 1e-2, "the adapter must change the numbers"


def test_registration_is_reversible_and_unknown_architectures_name_the_supported(acme_base):
    config = json.loads((acme_base / "config.json").read_text())
    with pytest.raises(AdapterValidationError, match="LlamaForCausalLM"):
        resolve_architecture(config)
    with pytest.raises(ModelLoadError, match=f"{ARCH}.*not supported.*Qwen3ForCausalLM"):
        LLM(str(acme_base), dtype="float32", device="cpu")
    register_family(acme_row())
    try:
        assert resolve_architecture(config).family == "acme"
        assert model_types_named("acme-labs/Acme-7B") == {"llama"}
        with pytest.raises(ValueError, match="already"):
            register_family(acme_row())
    finally:
        unregister_family("acme")
    assert "acme" not in FAMILIES and model_types_named("acme-labs/Acme-7B") == set()
    with pytest.raises(AdapterValidationError, match=ARCH):
        resolve_architecture(config)


def test_every_built_in_row_names_an_engine_module_with_its_spec():
    import importlib

    for family in FAMILIES.values():
        assert callable(importlib.import_module(family.module).decoder_spec), family.name
