"""LoRA on every family through the one batched path: 2-4 random PEFT adapters per family
(ranks 4..64, different target sets, rsLoRA, layers_to_transform) and base-model rows in one
mixed batch, every token teacher-forced against PEFT (float32, CPU). Phi-3's adapters target
its fused ``qkv_proj`` / ``gate_up_proj`` (one A shared by the slot's slices, B split by rows);
a multimodal Gemma 3's carry vision-tower LoRA that the text-only engine leaves out."""

from __future__ import annotations

import pytest
import torch
from support.lora_fixtures import ALL_MODULES, make_peft_adapter
from support.peft_harness import check_rows_match_peft, peft_prompts
from support.tiny_models import make_tiny_model

from loramux.engine import LLM, LoRARequest, SamplingParams

MAX_TOKENS = 8
FUSED = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]
FAMILIES = {  # name: (family, model overrides, [(rank, targets, rslora, extra LoraConfig)])
    "qwen3": ("qwen3", {}, [
        (4, ["q_proj", "v_proj"], False, {}),
        (16, ALL_MODULES, True, {}),
        (64, ["gate_proj", "up_proj", "down_proj"], False, {}),
        (8, ["k_proj", "o_proj"], False, {"layers_to_transform": [1]}),
    ]),
    "gemma3": ("gemma3", dict(num_hidden_layers=3, sliding_window=10, sliding_window_pattern=3), [
        (8, ["q_proj", "k_proj", "v_proj", "o_proj"], False, {}),
        (32, ALL_MODULES, True, {}),
        (4, ["down_proj"], False, {}),
    ]),
    "gemma3-multimodal": ("gemma3-mm", {}, [
        (8, ["q_proj", "v_proj"], False, {}),  # also the vision tower's q/v
        (16, "all-linear", False, {}),
    ]),
    "gemma2": ("gemma2", dict(num_hidden_layers=2), [
        (8, ALL_MODULES, False, {}),
        (16, ["q_proj", "v_proj"], True, {}),
    ]),
    "phi3": ("phi3", {}, [
        (4, ["qkv_proj"], False, {}),
        (16, FUSED, True, {}),
        (64, ["gate_up_proj", "down_proj"], False, {}),
    ]),
}


@pytest.fixture(scope="module")
def prompts(default_model_dir):
    return peft_prompts(default_model_dir, 70)  # a run longer than the SGMV kernel's: rank-only GEMMs


@pytest.mark.parametrize("name", list(FAMILIES))
def test_mixed_adapters_and_base_rows_match_peft(name, tmp_path, default_model_dir, prompts):
    family, overrides, specs = FAMILIES[name]
    base = make_tiny_model(tmp_path / name, default_model_dir, family, **overrides)
    adapters = [
        make_peft_adapter(base, tmp_path / f"a{i}", r=r, target_modules=t, use_rslora=rs, seed=i, std=0.1,
                          **extra)
        for i, (r, t, rs, extra) in enumerate(specs)
    ]
    llm = LLM(str(base), dtype="float32", device="cpu", max_model_len=128, enable_lora=True,
              max_loras=len(adapters), max_lora_rank=64, max_num_batched_tokens=96)
    # every adapter, twice where prompts allow, and base rows between them
    choice = [i % (len(adapters) + 1) for i in range(len(prompts))]
    choice = [None if c == len(adapters) else c for c in choice]
    loras = [None if c is None else LoRARequest(f"{name}-{c}", c + 1, str(adapters[c])) for c in choice]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, lora_request=loras)
    moved = check_rows_match_peft(base, adapters, prompts, choice, outs)
    assert len(moved) >= len(adapters) - 1


def test_fused_lora_fills_every_slice_of_the_slot(tmp_path, default_model_dir):
    """A Phi-3 ``qkv_proj`` LoRA sits in the slot as the same A in the q, k and v slices and
    B's rows split among them (and ``gate_up_proj`` likewise)."""
    from loramux.adapters.format import load_adapter
    from loramux.engine.lora.slots import SlotBuffers
    from loramux.engine.model.weights import dims_from_config, read_hf_config

    base = make_tiny_model(tmp_path / "phi3", default_model_dir, "phi3")
    adapter = make_peft_adapter(base, tmp_path / "a", r=4, target_modules=FUSED, seed=3)
    dims = dims_from_config(read_hf_config(base))
    weights = load_adapter(adapter)
    slots = SlotBuffers(dims, 2, 8, torch.float32, "cpu")
    slots.write(1, weights)
    a, b = weights.layers[0]["qkv_proj"]
    offs = slots.slice_offsets["qkv"]
    for s in range(3):
        assert torch.equal(slots.a[0]["qkv"][1, s, :4], a)
        assert torch.equal(slots.b[0]["qkv"][1, offs[s] : offs[s + 1], :4], b[offs[s] : offs[s + 1]])
    ga, gb = weights.layers[1]["gate_up_proj"]
    assert torch.equal(slots.a[1]["gate_up"][1, 1, :4], ga)
    assert slots.groups[1] == {"qkv", "o", "gate_up", "down"}
