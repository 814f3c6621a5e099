"""LoRA over a quantized base: PEFT adapters (LoRA, rsLoRA, DoRA; Phi-3's fused names) and
base rows in one mixed batch over a compressed-tensors int4 / int8 checkpoint, every token
teacher-forced against PEFT on transformers' dequantized load of the same checkpoint. The
adapters' shrink/expand run in the activations' dtype beside the banded base matmul; DoRA's
norms come from the dequantized base rows."""

from __future__ import annotations

import pytest
from support.lora_fixtures import ALL_MODULES, make_dora_adapter, make_peft_adapter
from support.peft_harness import check_rows_match_peft, peft_prompts
from support.quant_checkpoints import dequantized_reference, write_compressed
from support.tiny_models import make_tiny_model

from loramux.engine import LLM, LoRARequest, SamplingParams

FUSED = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]
CASES = {  # name: (family, bits, group, [(kind, rank, targets, extra)])
    "llama-int4-g32": ("llama", 4, 32, [
        ("lora", 8, ["q_proj", "v_proj"], {}),
        ("lora", 16, ALL_MODULES, {"use_rslora": True}),
        ("dora", 4, ["q_proj", "o_proj", "down_proj"], {}),
    ]),
    "phi3-int8-channel": ("phi3", 8, None, [
        ("lora", 4, ["qkv_proj"], {}),
        ("lora", 16, FUSED, {}),
    ]),
}


@pytest.mark.parametrize("name", list(CASES))
def test_adapters_over_a_quantized_base_match_peft(name, tmp_path, default_model_dir):
    family, bits, group, specs = CASES[name]
    src = make_tiny_model(tmp_path / "float", default_model_dir, family)
    folder = write_compressed(src, tmp_path / "quant", num_bits=bits, group_size=group)
    adapters = []
    for i, (kind, r, targets, extra) in enumerate(specs):
        make = make_dora_adapter if kind == "dora" else make_peft_adapter
        adapters.append(make(src, tmp_path / f"a{i}", r=r, target_modules=targets, seed=i,
                             std=0.1, **extra))
    llm = LLM(str(folder), dtype="float32", device="cpu", max_model_len=128, enable_lora=True,
              max_loras=len(adapters), max_lora_rank=16, max_num_batched_tokens=64)
    prompts = peft_prompts(default_model_dir, 40)
    choice = [i % (len(adapters) + 1) for i in range(len(prompts))]
    choice = [None if c == len(adapters) else c for c in choice]
    loras = [None if c is None else LoRARequest(f"{name}-{c}", c + 1, str(adapters[c])) for c in choice]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, lora_request=loras)
    refs = {c: dequantized_reference(folder, None if c is None else adapters[c]) for c in set(choice)}
    moved = check_rows_match_peft(folder, adapters, prompts, choice, outs, refs=refs)
    assert set(moved) == set(range(len(adapters)))  # every adapter changed its rows' numbers
