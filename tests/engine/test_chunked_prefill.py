"""Chunked prefill, prefix cache hits, forks and min_tokens on a tiny model, against
transformers/PEFT by teacher forcing (ARCHITECTURE.md, "Testing against the references")."""

from __future__ import annotations

import pytest
from support.lora_fixtures import (
    ALL_MODULES,
    make_peft_adapter,
    peft_reference,
    teacher_forcing_gaps,
)

from loramux.engine import LLM, LoRARequest, SamplingParams

TOL = 2e-3


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, tiny_model_dir):
    root = tmp_path_factory.mktemp("chunk-adapters")
    return [
        make_peft_adapter(tiny_model_dir, root / f"a{i}", r=8, target_modules=ALL_MODULES, seed=40 + i, std=0.3)
        for i in range(2)
    ]


@pytest.fixture(scope="module")
def refs(tiny_model_dir, adapters):
    return {None: peft_reference(tiny_model_dir, None)} | {
        str(p): peft_reference(tiny_model_dir, p) for p in adapters
    }


def record_plans(llm: LLM) -> list[dict[str, int]]:
    """Wrap the scheduler so each step's {request id: new tokens} is kept."""
    sched = llm.llm_engine.scheduler
    plans: list[dict[str, int]] = []
    inner = sched.schedule

    def schedule():
        plan = inner()
        plans.append({s.request_id: s.num_new_tokens for s in plan.scheduled})
        return plan

    sched.schedule = schedule
    return plans


def check(refs, outs, loras) -> None:
    for out, lora in zip(outs, loras, strict=True):
        ref = refs[lora.lora_path if lora is not None else None]
        gaps, _ = teacher_forcing_gaps(ref, out.prompt_token_ids, out.outputs[0].token_ids)
        assert max(gaps) <= TOL, (out.request_id, gaps)


@pytest.mark.parametrize("budget", [12, 15, 24])  # chunk edges at block edges and inside
def test_chunked_prompts_mixed_with_decodes_of_other_adapters(tiny_model_dir, adapters, refs, budget):
    llm = LLM(str(tiny_model_dir), dtype="float32", max_model_len=128, block_size=4,
              max_num_batched_tokens=budget, enable_lora=True, max_loras=2, enable_prefix_caching=False)
    plans = record_plans(llm)
    long_prompt = list(range(300, 341))  # 41 tokens: 2-5 chunks of what decodes leave over
    prompts = [[11, 12, 13], [21, 22], {"prompt_token_ids": long_prompt}, [31, 32, 33, 34]]
    loras = [LoRARequest("a0", 1, str(adapters[0])), None, LoRARequest("a1", 2, str(adapters[1])),
             LoRARequest("a0", 1, str(adapters[0]))]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    outs = llm.generate([p if isinstance(p, dict) else {"prompt_token_ids": p} for p in prompts], params,
                        lora_request=loras)
    check(refs, outs, loras)
    long_id = outs[2].request_id
    chunks = [p[long_id] for p in plans if p.get(long_id, 0) > 1]
    assert 2 <= len(chunks) <= 5 and sum(chunks) >= 40
    # decodes of other sequences ran in the same steps as the long prompt's chunks
    assert any(len(p) > 1 and p.get(long_id, 0) > 1 for p in plans)
    assert all(sum(p.values()) <= budget for p in plans)


def test_shared_prefix_hits_and_outputs_stay_exact(tiny_model_dir, adapters, refs):
    llm = LLM(str(tiny_model_dir), dtype="float32", max_model_len=160, block_size=4, max_num_batched_tokens=24,
              enable_lora=True, max_loras=2)
    engine = llm.llm_engine
    system = list(range(500, 541))  # a 41-token "system prompt"
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    lora = LoRARequest("a0", 1, str(adapters[0]))
    first = llm.generate({"prompt_token_ids": system + [7, 8]}, params, lora_request=lora)
    before = engine.stats()
    suffixes = [[9], [10, 11, 12], [13, 14, 15, 16, 17]]
    outs = llm.generate([{"prompt_token_ids": system + s} for s in suffixes], params, lora_request=[lora] * 3)
    after = engine.stats()
    assert after.prefix_cache_hits - before.prefix_cache_hits == 3 * 10  # 10 full blocks each
    check(refs, first + outs, [lora] * 4)
    # the base model and the other adapter, same tokens: no hits, and still exact
    base_and_other = llm.generate([{"prompt_token_ids": system + [9]}] * 2, params,
                                  lora_request=[None, LoRARequest("a1", 2, str(adapters[1]))])
    assert engine.stats().prefix_cache_hits == after.prefix_cache_hits
    check(refs, base_and_other, [None, LoRARequest("a1", 2, str(adapters[1]))])


def test_two_versions_of_one_adapter_never_share_blocks(tiny_model_dir, adapters, refs):
    llm = LLM(str(tiny_model_dir), dtype="float32", max_model_len=128, block_size=4, enable_lora=True)
    prompt = {"prompt_token_ids": list(range(600, 630))}
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    v1 = LoRARequest("same-name", 1, str(adapters[0]))
    v2 = LoRARequest("same-name", 1, str(adapters[1]))  # the name re-pointed at other weights
    out1 = llm.generate(prompt, params, lora_request=v1)
    hits = llm.llm_engine.stats().prefix_cache_hits
    out2 = llm.generate(prompt, params, lora_request=v2)
    assert llm.llm_engine.stats().prefix_cache_hits == hits
    check(refs, out1 + out2, [v1, v2])


def test_n4_forks_share_the_prompt_blocks_and_match_separate_seeded_requests(tiny_model_dir):
    prompt = {"prompt_token_ids": [(7 * i) % 900 + 50 for i in range(200)]}
    llm = LLM(str(tiny_model_dir), dtype="float32", max_model_len=256, block_size=16,
              max_num_batched_tokens=256, enable_prefix_caching=False)
    engine = llm.llm_engine
    engine.add_request("fork", prompt, SamplingParams(n=4, temperature=1.0, seed=5, max_tokens=6, ignore_eos=True))
    engine.step()
    used = engine.kv.pool.num_blocks - engine.kv.num_free_blocks
    assert used == engine.kv.blocks_for(200)  # one prompt's worth, shared by the 4 forks
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.finished]
    assert engine.kv.num_free_blocks == engine.kv.pool.num_blocks
    forked = sorted(c.token_ids for c in outs[0].outputs)
    separate = llm.generate(
        [prompt] * 4,
        [SamplingParams(temperature=1.0, seed=5 + i * 1_000_003, max_tokens=6, ignore_eos=True) for i in range(4)],
    )
    assert forked == sorted(o.outputs[0].token_ids for o in separate)
    assert len({tuple(t) for t in forked}) > 1


def test_min_tokens_blocks_eos_even_with_ignore_eos(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), dtype="float32", max_model_len=128)
    eos = llm.get_tokenizer().eos_token_id
    push = {eos: 100.0}  # EOS is the argmax everywhere
    outs = llm.generate(
        [{"prompt_token_ids": [5, 6, 7]}],
        SamplingParams(temperature=0, min_tokens=64, max_tokens=70, ignore_eos=True, logit_bias=push),
    )
    ids = outs[0].outputs[0].token_ids
    assert len(ids) == 70 and eos not in ids[:64] and ids[64:] == [eos] * 6
    stop = llm.generate(
        [{"prompt_token_ids": [5, 6, 7]}],
        SamplingParams(temperature=0, min_tokens=5, max_tokens=20, logit_bias=push),
    )[0].outputs[0]
    assert len(stop.token_ids) == 6 and stop.finish_reason == "stop"
