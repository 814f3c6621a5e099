"""Quantized bases under tensor parallelism (gloo, 2 ranks on the CPU): compressed-tensors
pack-quantized and FP8, AWQ and GPTQ (v1, v2; 4 and 8 bits; groups and per channel) shard as
stored, each rank reading the packed words, groups and scales of its output rows or input
columns, and serve base rows, LoRA and DoRA rows as one process does (TP 1 of the same folder,
itself checked against PEFT in ``test_awq_gptq_lora.py`` / ``test_quant_lora.py``). Under GPTQ's
activation order a row-parallel share's columns draw on every group: they are regrouped
(``repacked.regroup``: sorted by group, padded to whole sub-groups) and served as one process.
Quantized MoE experts split like float ones (each rank its share of every expert's
intermediate size, read from the packed words and groups)."""

from __future__ import annotations

import pytest
from awq_gptq_layouts import write_awq, write_gptq
from ct_moe_checkpoint import write_int4_experts
from fp8_checkpoints import write_fp8
from support.lora_fixtures import ALL_MODULES, make_dora_adapter, make_peft_adapter
from support.peft_harness import peft_prompts
from support.quant_checkpoints import write_compressed
from support.tiny_models import make_tiny_model

from loramux.engine import LLM, LoRARequest, SamplingParams

pytestmark = pytest.mark.timeout(600)

SCHEMES = {  # name: (writer, options)
    "ct-int4-g16-asym": (write_compressed, dict(num_bits=4, group_size=16, symmetric=False)),
    "ct-int8-channel": (write_compressed, dict(num_bits=8, group_size=None)),
    "ct-fp8-channel": (write_fp8, dict(strategy="channel")),
    "ct-fp8-tensor": (write_fp8, dict(strategy="tensor")),
    "awq-g16": (write_awq, dict(group_size=16)),
    "awq-channel-symmetric": (write_awq, dict(group_size=-1, zero_point=False)),
    "gptq-int4-g16": (write_gptq, dict(group_size=16)),
    "gptq-v2-int8-g32-asym": (write_gptq, dict(bits=8, group_size=32, sym=False, fmt="gptq_v2")),
    "gptq-channel": (write_gptq, dict(group_size=-1)),
    # activation order: o's and down's shares regrouped (g16: the torch path; g32: the kernel)
    "gptq-int4-g16-desc-act": (write_gptq, dict(group_size=16, desc_act=True)),
    "gptq-v2-int8-g32-desc-act-asym": (write_gptq, dict(bits=8, group_size=32, desc_act=True, sym=False,
                                                         fmt="gptq_v2")),
    "gptq-int4-g64-desc-act": (write_gptq, dict(group_size=64, desc_act=True)),
}


@pytest.fixture(scope="module")
def prompts(default_model_dir):
    return peft_prompts(default_model_dir, 40)


def _run(base, tp: int, rows, loras, params):
    llm = LLM(str(base), dtype="float32", device="cpu", max_model_len=128, enable_lora=True,
              max_loras=2, max_lora_rank=8, max_num_batched_tokens=48, tensor_parallel_size=tp)
    outs = llm.generate([{"prompt_token_ids": p} for p in rows], params, lora_request=loras)
    if tp > 1:
        llm.llm_engine.runner.shutdown()
    return [(o.outputs[0].token_ids, [{t: lp.logprob for t, lp in e.items()} for e in o.outputs[0].logprobs])
            for o in outs]


@pytest.mark.parametrize("name", list(SCHEMES))
def test_a_quantized_base_shards_as_stored_and_serves_lora_and_dora_as_one_process(name, tmp_path,
                                                                                  default_model_dir, prompts):
    writer, options = SCHEMES[name]
    dense = make_tiny_model(tmp_path / "dense", default_model_dir, "qwen3")
    base = writer(dense, tmp_path / "q", **options)
    lora = make_peft_adapter(dense, tmp_path / "lora", r=8, target_modules=ALL_MODULES, std=0.1)
    dora = make_dora_adapter(dense, tmp_path / "dora", r=4, target_modules=["q_proj", "o_proj", "down_proj"],
                             std=0.1)
    rows = prompts[:6]
    loras = [None, LoRARequest("lora", 1, str(lora)), LoRARequest("dora", 2, str(dora))] * 2
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3)
    _same_rows(_run(base, 1, rows, loras, params), _run(base, 2, rows, loras, params))


def _same_rows(one, two) -> None:
    assert [t for t, _ in two] == [t for t, _ in one]
    for (_, a), (_, b) in zip(one, two, strict=True):
        for x, y in zip(a, b, strict=True):
            assert x.keys() == y.keys() and all(abs(x[t] - y[t]) < 1e-4 for t in x)


MOE_SCHEMES = {
    "ct-int4-g16": lambda src, out: write_int4_experts(src, out, out.with_name("ref")) or out,
    "awq-g16": lambda src, out: write_awq(src, out, group_size=16),
    "gptq-int4-g16": lambda src, out: write_gptq(src, out, group_size=16),
}


@pytest.mark.parametrize("name", list(MOE_SCHEMES))
def test_quantized_experts_shard_their_intermediate_size_as_one_process_serves(name, tmp_path,
                                                                              default_model_dir, prompts):
    dense = make_tiny_model(tmp_path / "dense", default_model_dir, "qwen3_moe")
    base = MOE_SCHEMES[name](dense, tmp_path / "q")
    lora = make_peft_adapter(dense, tmp_path / "lora", r=8, target_modules=["q_proj", "o_proj"], std=0.1)
    rows = prompts[:4]
    loras = [None, LoRARequest("lora", 1, str(lora))] * 2
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3)
    _same_rows(_run(base, 1, rows, loras, params), _run(base, 2, rows, loras, params))
