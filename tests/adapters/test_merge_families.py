"""merge_and_unload export on every family: the merged folder's logits equal PEFT's base +
adapter (``check=True``), and the engine serving the merged folder as a plain base gives the
logprobs the engine gives for base + adapter. Phi-3 adapters on split names (mapped onto
its fused projections) are merged through their fused rewrite (``adapters/fused.py``); MoE
adapters with LoRA on the experts (``target_parameters``, or ``gate_proj`` / ``up_proj`` /
``down_proj`` (Mixtral: ``w1`` / ``w3`` / ``w2``) that PEFT maps onto them) merge into the
expert weights. DoRA adapters too: PEFT-made ones (rsLoRA, partial targets, Phi-3's fused
names) and a split-name DoRA on Phi-3 that leaves k out (its rows take the base's norms in the
fused rewrite)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from support.adapters import write_random_adapter
from support.lora_fixtures import ALL_MODULES, make_dora_adapter, make_peft_adapter
from support.tiny_models import make_tiny_llama, make_tiny_model

from loramux.adapters.merge import export_merged
from loramux.engine import LLM, LoRARequest, SamplingParams


def _split_dora(base, out):
    """A DoRA adapter on Phi-3's split names q/v/up/down (PEFT cannot make one: Phi-3 has no
    q_proj): random A/B and magnitudes near the tiny model's row norms."""
    folder = write_random_adapter(base, out, r=4, target_modules=("q_proj", "v_proj", "up_proj", "down_proj"),
                                  std=0.1, base_model_name_or_path=str(base))
    tensors = load_file(str(folder / "adapter_model.safetensors"))
    g = torch.Generator().manual_seed(0)
    for key in [k for k in tensors if k.endswith("lora_B.weight")]:
        rows = tensors[key].shape[0]
        tensors[key.replace("lora_B.weight", "lora_magnitude_vector")] = (
            0.64 * (1 + 0.3 * torch.randn(rows, generator=g)))
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    config = json.loads((folder / "adapter_config.json").read_text())
    config["use_dora"] = True
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return folder


CASES = {  # name: (family, model overrides, adapter maker(base, out))
    "llama-dora": ("llama", {}, lambda base, out: make_dora_adapter(
        base, out, r=8, target_modules=ALL_MODULES, use_rslora=True, std=0.1)),
    "qwen2-dora": ("qwen2", {}, lambda base, out: make_dora_adapter(
        base, out, r=4, target_modules=["q_proj", "k_proj", "down_proj"], std=0.1,
        layers_to_transform=[1])),
    "gemma3-dora": ("gemma3", dict(num_hidden_layers=3), lambda base, out: make_dora_adapter(
        base, out, r=16, target_modules=ALL_MODULES, std=0.1)),
    "phi3-fused-dora": ("phi3", {}, lambda base, out: make_dora_adapter(
        base, out, r=8, target_modules=["qkv_proj", "o_proj", "gate_up_proj", "down_proj"], std=0.1)),
    "phi3-split-dora": ("phi3", {}, _split_dora),
    "gemma3-multimodal-dora": ("gemma3-mm", {}, lambda base, out: make_dora_adapter(
        base, out, r=4, target_modules=["q_proj", "v_proj", "down_proj"], std=0.1)),  # + vision tower
    "qwen3": ("qwen3", {}, lambda base, out: make_peft_adapter(
        base, out, r=8, target_modules=ALL_MODULES, use_rslora=True, std=0.1)),
    "gemma3": ("gemma3", dict(num_hidden_layers=3), lambda base, out: make_peft_adapter(
        base, out, r=4, target_modules=ALL_MODULES, std=0.1)),
    "gemma3-multimodal": ("gemma3-mm", {}, lambda base, out: make_peft_adapter(
        base, out, r=4, target_modules=["q_proj", "v_proj", "down_proj"], std=0.1)),
    "phi3-fused": ("phi3", {}, lambda base, out: make_peft_adapter(
        base, out, r=8, target_modules=["qkv_proj", "o_proj", "gate_up_proj", "down_proj"], std=0.1)),
    "phi3-split": ("phi3", {}, lambda base, out: write_random_adapter(
        base, out, r=4, target_modules=("q_proj", "v_proj", "up_proj", "down_proj"), use_rslora=True,
        std=0.1, base_model_name_or_path=str(base))),
    "qwen3_moe-experts": ("qwen3_moe", dict(num_hidden_layers=3, mlp_only_layers=[1]), lambda base, out:
                          make_peft_adapter(base, out, r=4, target_modules=["q_proj", "v_proj"], std=0.2,
                                            target_parameters=["mlp.experts.gate_up_proj",
                                                               "mlp.experts.down_proj"])),
    "qwen3_moe-all-linear": ("qwen3_moe", {}, lambda base, out: make_peft_adapter(
        base, out, r=4, target_modules="all-linear", std=0.2)),  # + the router, gate_up at rank 8
    "mixtral-mapped-experts": ("mixtral", {}, lambda base, out: make_peft_adapter(
        base, out, r=4, target_modules=["o_proj", "w1", "w2", "w3"], std=0.2)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_export_matches_peft_and_the_engine(name, tmp_path, default_model_dir):
    family, overrides, make = CASES[name]
    if family in ("llama", "qwen2"):
        base = make_tiny_llama(tmp_path / name, default_model_dir, architecture=family)
    else:
        base = make_tiny_model(tmp_path / name, default_model_dir, family, **overrides)
    adapter = make(base, tmp_path / "adapter")
    merged = export_merged(base, adapter, tmp_path / "merged", check=True, atol=1e-4, progress=False)
    arch = json.loads((merged / "config.json").read_text())["architectures"]
    assert arch == json.loads((base / "config.json").read_text())["architectures"]

    prompts = [[1, 500, 501, 502, 503], list(range(700, 730))]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3)
    with_lora = LLM(str(base), dtype="float32", device="cpu", max_model_len=64, enable_lora=True,
                    max_loras=1, max_lora_rank=16)
    lora = LoRARequest("a", 1, str(adapter))
    want = with_lora.generate([{"prompt_token_ids": p} for p in prompts], params, lora_request=[lora, lora])
    plain = LLM(str(merged), dtype="float32", device="cpu", max_model_len=64)
    got = plain.generate([{"prompt_token_ids": p} for p in prompts], params)
    base_only = with_lora.generate([{"prompt_token_ids": p} for p in prompts], params)
    for w, g in zip(want, got, strict=True):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        for we, ge in zip(w.outputs[0].logprobs, g.outputs[0].logprobs, strict=True):
            for tok, lp in we.items():
                assert ge[tok].logprob == pytest.approx(lp.logprob, abs=2e-4)
    changed = [w.outputs[0].logprobs[0] != b.outputs[0].logprobs[0] for w, b in zip(want, base_only, strict=True)]
    assert any(changed), "the adapter changes nothing: the test would pass for any merge"
