"""Speculative decoding (ngram) on a tiny model: outputs with speculation equal those without
(greedy, and seeded sampling: each position draws from the sequence's generator as a decode
step would) over mixed adapters, chunked prefill, prefix-cache hits, preemption and n > 1;
logprobs, stop strings, max_tokens and structured output; the KV blocks all come back."""

from __future__ import annotations

import pytest
from support.lora_fixtures import ALL_MODULES, make_peft_adapter

from loramux.engine import LLM, LoRARequest, SamplingParams

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3,
        "prompt_lookup_min": 1}
PROMPTS = [
    "SELECT name FROM users WHERE id = 1; SELECT name FROM users WHERE id = 2; SELECT",
    "def f(x):\n    return x + 1\n\ndef g(x):\n    return x + 1\n\ndef h(x):\n",
    "name: Ada, city: Paris. name: Bob, city: Rome. name: Ada, city:",
    "hello world",
]


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, tiny_model_dir):
    root = tmp_path_factory.mktemp("spec-adapters")
    return [make_peft_adapter(tiny_model_dir, root / f"a{i}", r=8, target_modules=ALL_MODULES,
                              seed=70 + i, std=0.3) for i in range(2)]


def make(tiny_model_dir, spec: bool, **kw) -> LLM:
    opts = dict(dtype="float32", max_model_len=256, block_size=4, enable_lora=True, max_loras=2)
    opts.update(kw)
    return LLM(str(tiny_model_dir), speculative_config=SPEC if spec else None, **opts)


def loras_for(adapters, n: int) -> list[LoRARequest | None]:
    pool = [LoRARequest("a0", 1, str(adapters[0])), None, LoRARequest("a1", 2, str(adapters[1]))]
    return [pool[i % 3] for i in range(n)]


def run_both(tiny_model_dir, prompts, params, loras=None, rounds: int = 1, **kw):
    """Both engines' outputs of ``rounds`` generate calls each (later rounds hit the prefix
    cache the first filled), and the speculative one's counters."""
    outs = []
    for spec in (False, True):
        llm = make(tiny_model_dir, spec, **kw)
        outs.append([o for _ in range(rounds) for o in llm.generate(prompts, params, lora_request=loras)])
        eng = llm.llm_engine
        assert eng.kv.num_free_blocks == eng.kv.pool.num_blocks  # rejected drafts' blocks too
    return outs[0], outs[1], eng.stats().spec_decode | {"_preemptions": eng.scheduler.num_preemptions}


def tokens(outs):
    return [[c.token_ids for c in o.outputs] for o in outs]


def accepted(stats) -> int:
    return sum(c.num_accepted_tokens for k, c in stats.items() if k != "_preemptions")


@pytest.mark.parametrize("kw", [
    {},  # mixed adapters, one step budget
    {"max_num_batched_tokens": 12},  # chunked prefill beside verify rows
    {"num_gpu_blocks_override": 40},  # preemption (recompute)
], ids=["mixed-adapters", "chunked-prefill", "preemption"])
def test_greedy_equals_no_speculation(tiny_model_dir, adapters, kw):
    prompts = PROMPTS * 2
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    base, spec, stats = run_both(tiny_model_dir, prompts, params, loras_for(adapters, len(prompts)), **kw)
    assert tokens(spec) == tokens(base)
    assert [o.outputs[0].text for o in spec] == [o.outputs[0].text for o in base]
    assert accepted(stats) > 0, stats  # speculation really ran
    assert set(stats) >= {"base"} and len(stats) >= 3  # counted per adapter
    if "num_gpu_blocks_override" in kw:
        assert stats["_preemptions"] > 0


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded-sampling"])
def test_prefix_cache_hits_and_n(tiny_model_dir, adapters, sampled):
    shared = PROMPTS[0] * 3
    prompts = [shared + " a", shared + " b", shared + " a"]
    params = SamplingParams(temperature=0.5, top_k=3, top_p=0.95, seed=11, n=3, max_tokens=32,
                            ignore_eos=True) if sampled else SamplingParams(
        temperature=0, n=2, max_tokens=32, ignore_eos=True)
    base, spec, stats = run_both(tiny_model_dir, prompts, params, loras_for(adapters, 3)[:1] * 3, rounds=2)
    assert tokens(spec) == tokens(base)
    assert all(o.num_cached_tokens > 0 for o in spec[3:])
    assert accepted(stats) > 0


def test_logprobs_stop_strings_and_max_tokens(tiny_model_dir, adapters):
    greedy = SamplingParams(temperature=0, max_tokens=40, logprobs=3, ignore_eos=True)
    base, spec, _ = run_both(tiny_model_dir, PROMPTS, greedy, loras_for(adapters, 4))
    for b, s in zip(base, spec, strict=True):
        bo, so = b.outputs[0], s.outputs[0]
        assert so.token_ids == bo.token_ids
        assert abs(so.cumulative_logprob - bo.cumulative_logprob) < 1e-3
        for lb, ls in zip(bo.logprobs, so.logprobs, strict=True):
            assert lb.keys() == ls.keys()
            assert all(abs(lb[t].logprob - ls[t].logprob) < 1e-3 and lb[t].rank == ls[t].rank for t in lb)
    # a stop string inside a run of accepted drafts, and max_tokens cut by the drafts' cap
    stop_word = base[0].outputs[0].text[12:16]
    for max_tokens in (1, 2, 7):
        p = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        b, s, _ = run_both(tiny_model_dir, PROMPTS, p, loras_for(adapters, 4))
        assert tokens(s) == tokens(b) and all(len(o.outputs[0].token_ids) == max_tokens for o in s)
    p = SamplingParams(temperature=0, max_tokens=40, stop=[stop_word], ignore_eos=True)
    b, s, _ = run_both(tiny_model_dir, PROMPTS, p, loras_for(adapters, 4))
    assert [o.outputs[0].text for o in s] == [o.outputs[0].text for o in b]
    assert s[0].outputs[0].finish_reason == "stop" and s[0].outputs[0].stop_reason == stop_word


def test_structured_output_rows_are_not_drafted(tiny_model_dir):
    p = SamplingParams(temperature=0, max_tokens=20,
                       structured_outputs={"regex": r"(ab){3}[0-9]{4}-[a-z]{2}"})
    base, spec, stats = run_both(tiny_model_dir, ["ab ab ab 1234 ab ab"], p, enable_lora=False)
    assert tokens(spec) == tokens(base)
    assert accepted(stats) == 0 and len(stats) == 1  # a guided row never drafts


def test_speculative_config_is_validated(tiny_model_dir):
    from loramux.engine.spec_decode import SpeculativeConfig

    cfg = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 3}')
    assert (cfg.prompt_lookup_min, cfg.prompt_lookup_max) == (5, 5)  # vLLM's default
    assert SpeculativeConfig.parse({"num_speculative_tokens": 2, "prompt_lookup_max": 4}).prompt_lookup_min == 4
    assert SpeculativeConfig.parse(None) is None and SpeculativeConfig.parse("") is None
    for bad, match in [
        ({"method": "eagle", "num_speculative_tokens": 2}, "method"),
        ({"method": "ngram"}, "num_speculative_tokens"),
        ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"num_speculative_tokens": 99}, "num_speculative_tokens"),
        ({"num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "prompt_lookup_min"),
        ({"num_speculative_tokens": 2, "prompt_lookup_max": 0}, "prompt_lookup_max"),
        ({"num_speculative_tokens": 2, "draft_tensor_parallel_size": 1}, "unknown keys"),
        ("{not json", "JSON"),
        ("[1]", "JSON object"),
    ]:
        with pytest.raises(ValueError, match=match):
            SpeculativeConfig.parse(bad)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        LLM(str(tiny_model_dir), speculative_config={"method": "ngram"})


def test_streaming_through_the_async_engine(tiny_model_dir):
    """Several tokens per step reach a streaming caller in order, and the end is the
    non-speculative output."""
    import asyncio

    from loramux.engine.async_engine import AsyncEngine

    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    want = make(tiny_model_dir, False, enable_lora=False).generate(PROMPTS[1], params)[0].outputs[0]
    eng = AsyncEngine(make(tiny_model_dir, True, enable_lora=False).llm_engine)

    async def go():
        seen = []
        async for out in eng.generate(PROMPTS[1], params):
            seen.append(list(out.outputs[0].token_ids))
        return seen, out.outputs[0]

    try:
        seen, final = asyncio.run(go())
    finally:
        eng.shutdown()
    assert final.token_ids == want.token_ids and final.text == want.text
    assert all(b[: len(a)] == a for a, b in zip(seen, seen[1:], strict=False))
    assert max(len(b) - len(a) for a, b in zip(seen, seen[1:], strict=False)) > 1  # a step took drafts


def _two_sample_pvalue(a: dict, b: dict) -> float:
    """Chi-square test that two samples of categories come from one distribution (categories
    with fewer than 10 counts in both pooled into one)."""
    import torch

    cats = sorted(set(a) | set(b))
    big = [c for c in cats if a.get(c, 0) + b.get(c, 0) >= 10]
    rows = [[a.get(c, 0) for c in big] + [sum(a.get(c, 0) for c in cats if c not in big)],
            [b.get(c, 0) for c in big] + [sum(b.get(c, 0) for c in cats if c not in big)]]
    if rows[0][-1] + rows[1][-1] == 0:
        rows = [r[:-1] for r in rows]
    na, nb = sum(rows[0]), sum(rows[1])
    stat = 0.0
    for j in range(len(rows[0])):
        tot = rows[0][j] + rows[1][j]
        for r, n in ((rows[0], na), (rows[1], nb)):
            exp = tot * n / (na + nb)
            stat += (r[j] - exp) ** 2 / exp
    df = len(rows[0]) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


@pytest.mark.slow
def test_unseeded_sampling_has_the_same_distribution_chi_square(tiny_model_dir):
    """The engine's own sampled tokens (unseeded, temperature 1, four allowed tokens that the
    prompt repeats, so nearly every step drafts, skewed) at output positions 2-5, with and without
    speculation: a two-sample chi-square test per position."""
    import random
    from collections import Counter

    vocab = [100, 200, 300, 400]
    rng = random.Random(0)
    prompt = {"prompt_token_ids": [rng.choice(vocab) for _ in range(40)]}
    # skewed by a logit bias (the tiny model is near uniform): drafts copied from the uniform
    # prompt are often unlikely tokens, so accepting too many would show
    params = SamplingParams(temperature=1.0, max_tokens=5, ignore_eos=True, allowed_token_ids=vocab,
                            logit_bias={100: 1.5, 200: 0.7})
    counts = []
    for spec in (False, True):
        llm = make(tiny_model_dir, spec, enable_lora=False, max_num_seqs=2, seed=5 + spec,
                   enable_step_budget=False)
        outs = llm.generate([prompt] * 500, params)
        counts.append([Counter(o.outputs[0].token_ids[p] for o in outs) for p in (1, 2, 3, 4)])
        stats = llm.llm_engine.stats().spec_decode
    assert accepted(stats) > 200, stats  # many positions came out of accepted drafts
    for pos in range(4):
        p = _two_sample_pvalue(counts[0][pos], counts[1][pos])
        assert p > 1e-3, (pos, p, counts[0][pos], counts[1][pos])
