"""LoRA over AWQ and GPTQ bases: PEFT adapters (LoRA, rsLoRA, DoRA; Phi-3's fused names) and
base rows in one mixed batch (chunked prefill), every token teacher-forced against PEFT on
transformers over the format's reference dequantization of the same checkpoint. DoRA's
norms come from the dequantized base rows (``QuantLinear.row_norms``), in the checkpoint's
input-column order under GPTQ's activation order too."""

from __future__ import annotations

import pytest
from awq_gptq_layouts import write_awq, write_dequantized, write_gptq
from support.lora_fixtures import ALL_MODULES, make_dora_adapter, make_peft_adapter
from support.peft_harness import check_rows_match_peft, peft_prompts
from support.tiny_models import make_tiny_model

from loramux.engine import LLM, LoRARequest, SamplingParams

FUSED = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]
CASES = {  # name: (family, writer, options, [(kind, rank, targets, extra)])
    "llama-awq-g32": ("llama", write_awq, dict(group_size=32), [
        ("lora", 8, ["q_proj", "v_proj"], {}),
        ("dora", 4, ["q_proj", "o_proj", "down_proj"], {}),
    ]),
    "llama-gptq-desc-act": ("llama", write_gptq, dict(group_size=32, desc_act=True), [
        ("lora", 16, ALL_MODULES, {"use_rslora": True}),
        ("dora", 4, ["q_proj", "o_proj", "gate_proj"], {}),
    ]),
    "phi3-gptq-int8": ("phi3", write_gptq, dict(bits=8, group_size=32, sym=False), [
        ("lora", 16, FUSED, {}),
    ]),
}


@pytest.mark.parametrize("name", list(CASES))
def test_adapters_over_awq_and_gptq_match_peft(name, tmp_path, default_model_dir):
    family, writer, opts, specs = CASES[name]
    src = make_tiny_model(tmp_path / "float", default_model_dir, family)
    folder = writer(src, tmp_path / "quant", **opts)
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
    base = write_dequantized(folder, tmp_path / "deq")
    moved = check_rows_match_peft(base, adapters, prompts, choice, outs)
    assert set(moved) == set(range(len(adapters)))  # every adapter changed its rows' numbers
