"""``fully_sharded_loras`` (vLLM's option; the S-LoRA layout, ``engine/lora/sharded.py``) on
the CPU with gloo: A split by rank on q|k|v and gate|up, B by output columns on o and down, one
collective per LoRA group and layer. The tokens and logprobs equal the default layout's, and
both are PEFT's (teacher-forced), for split and fused projections, replicated KV heads, DoRA
and plain LoRA and base rows in one batch, adapters of ranks below the slots' (some ranks
then hold no rank row of an adapter). Each rank's slots are smaller; options that cannot split
are refused naming them."""

from __future__ import annotations

import pytest
from support.lora_fixtures import ALL_MODULES, make_dora_adapter, make_peft_adapter
from support.peft_harness import check_rows_match_peft, peft_prompts
from support.tiny_models import make_tiny_model

from loramux.engine import LLM, LoRARequest, SamplingParams

pytestmark = pytest.mark.timeout(600)

FUSED = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]
CASES = {  # name: (family, tp, [(kind, rank, targets)])
    "qwen3-tp2": ("qwen3", 2, [("lora", 16, ALL_MODULES), ("dora", 8, ALL_MODULES),
                               ("lora", 4, ["q_proj", "v_proj", "down_proj"])]),
    "phi3-tp2-fused": ("phi3", 2, [("lora", 8, FUSED), ("lora", 16, ["qkv_proj", "gate_up_proj"])]),
    "gemma3-tp4-replicated-kv": ("gemma3", 4, [("lora", 16, ALL_MODULES), ("lora", 4, ALL_MODULES)]),
}


@pytest.fixture(scope="module")
def prompts(default_model_dir):
    return peft_prompts(default_model_dir, 40)


def _generate(base, adapters, tp, fully_sharded, rows, choice):
    llm = LLM(str(base), dtype="float32", device="cpu", max_model_len=128, enable_lora=True,
              max_loras=len(adapters), max_lora_rank=16, max_num_batched_tokens=48,
              tensor_parallel_size=tp, fully_sharded_loras=fully_sharded)
    loras = [None if c is None else LoRARequest(f"a{c}", c + 1, str(adapters[c])) for c in choice]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)
    outs = llm.generate([{"prompt_token_ids": p} for p in rows], params, lora_request=loras)
    slot_bytes = llm.llm_engine.lora_manager.buffers.num_bytes()
    llm.llm_engine.runner.shutdown()
    return outs, slot_bytes


@pytest.mark.parametrize("name", list(CASES))
def test_fully_sharded_adapters_equal_the_default_layout_and_peft(name, tmp_path, default_model_dir, prompts):
    family, tp, specs = CASES[name]
    base = make_tiny_model(tmp_path / name, default_model_dir, family)
    adapters = [(make_dora_adapter if kind == "dora" else make_peft_adapter)(
        base, tmp_path / f"a{i}", r=r, target_modules=t, seed=i, std=0.2) for i, (kind, r, t) in enumerate(specs)]
    rows = prompts[:8]
    choice = [i % (len(adapters) + 1) for i in range(len(rows))]
    choice = [None if c == len(adapters) else c for c in choice]
    sharded, sharded_bytes = _generate(base, adapters, tp, True, rows, choice)
    default, default_bytes = _generate(base, adapters, tp, False, rows, choice)
    for a, b in zip(sharded, default, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            assert x.keys() == y.keys() and all(abs(x[t].logprob - y[t].logprob) < 1e-4 for t in x)
    assert set(check_rows_match_peft(base, adapters, rows, choice, sharded)) == set(range(len(adapters)))
    assert sharded_bytes < default_bytes  # rank 0 holds a share of A and of B


@pytest.mark.parametrize("options, why", [
    (dict(max_lora_rank=6, tensor_parallel_size=4), "max_lora_rank 6 is not divisible"),
    (dict(max_lora_rank=8, tensor_parallel_size=4, hidden_size=130), "splits o's 130 output columns"),
    (dict(max_lora_rank=16, tensor_parallel_size=2, lora_backend="triton"), "fully_sharded_loras runs on the torch"),
])
def test_options_that_cannot_split_are_refused_naming_them(options, why, tmp_path, default_model_dir):
    options = dict(options)
    hidden = options.pop("hidden_size", None)
    base = make_tiny_model(tmp_path / "m", default_model_dir, "qwen3", **({"hidden_size": hidden} if hidden else {}))
    with pytest.raises((ValueError, RuntimeError), match=why):
        LLM(str(base), dtype="float32", device="cpu", max_model_len=64, enable_lora=True, max_loras=1,
            fully_sharded_loras=True, **options)
