"""Beam search against transformers' own beam search on a tiny model."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    from loramux.engine import LLM

    return LLM(str(tiny_model_dir), dtype="float32", max_model_len=128)


def test_beam_search_matches_transformers(llm, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    from loramux.engine import BeamSearchParams

    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    prompt = "The quick brown fox"
    out = llm.beam_search([prompt], BeamSearchParams(beam_width=3, max_tokens=6, ignore_eos=True))[0]
    assert len(out.sequences) == 3
    ids = llm.get_tokenizer()(prompt).input_ids
    with torch.no_grad():
        ref = hf.generate(torch.tensor([ids]), num_beams=3, num_return_sequences=3, max_new_tokens=6,
                          min_new_tokens=6, do_sample=False, early_stopping=False, length_penalty=1.0,
                          pad_token_id=0)
    ours_best = out.sequences[0].tokens[len(ids):]
    assert ours_best == ref[0, len(ids):].tolist()
    scores = [s.cum_logprob for s in out.sequences]
    assert scores == sorted(scores, reverse=True)
    # The best beam's score is the sum of its token logprobs under the model.
    with torch.no_grad():
        lp = torch.log_softmax(hf(torch.tensor([out.sequences[0].tokens])).logits[0], -1)
    total = sum(lp[len(ids) - 1 + j, t].item() for j, t in enumerate(ours_best))
    assert out.sequences[0].cum_logprob == pytest.approx(total, abs=1e-3)


def test_beam_width_one_is_greedy(llm):
    from loramux.engine import BeamSearchParams, SamplingParams

    greedy = llm.generate(["Hello world"], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    beam = llm.beam_search(["Hello world"], BeamSearchParams(beam_width=1, max_tokens=5, ignore_eos=True))
    n = len(greedy[0].prompt_token_ids)
    assert beam[0].sequences[0].tokens[n:] == greedy[0].outputs[0].token_ids


def test_beam_params_validated():
    from loramux.engine import BeamSearchParams

    with pytest.raises(ValueError, match="beam_width"):
        BeamSearchParams(beam_width=0, max_tokens=4)


def test_beam_search_rounds_reuse_the_cached_prefix(tiny_model_dir):
    from loramux.engine import LLM, BeamSearchParams

    llm = LLM(str(tiny_model_dir), dtype="float32", max_model_len=128, block_size=4)
    plans: list[int] = []
    sched = llm.llm_engine.scheduler
    inner = sched.schedule

    def schedule():
        plan = inner()
        plans.append(plan.num_batched_tokens)
        return plan

    sched.schedule = schedule
    prompt = {"prompt_token_ids": list(range(200, 240))}  # 40 tokens
    llm.beam_search([prompt], BeamSearchParams(beam_width=2, max_tokens=5, ignore_eos=True))
    # round 1 computes the prompt; later rounds only each beam's last partial block (< 2 x 4 tokens)
    assert plans[0] >= 36 and all(n <= 2 * 4 for n in plans[1:])
    assert llm.llm_engine.stats().prefix_cache_hits > 0


def test_async_use_beam_search_equals_offline_beam_search(tiny_model_dir):
    import asyncio

    from loramux.engine import LLM, BeamSearchParams, SamplingParams
    from loramux.engine.async_engine import AsyncEngine

    llm = LLM(str(tiny_model_dir), dtype="float32", max_model_len=128)
    prompt = {"prompt_token_ids": list(range(300, 312))}
    offline = llm.beam_search([prompt], BeamSearchParams(beam_width=3, max_tokens=5, ignore_eos=True,
                                                         length_penalty=0.5))[0]
    engine = AsyncEngine(llm.llm_engine)

    async def go():
        params = SamplingParams(n=2, best_of=3, use_beam_search=True, max_tokens=5, ignore_eos=True,
                                length_penalty=0.5, temperature=0.7)
        return [o async for o in engine.generate(prompt, params, "beam")]

    try:
        (out,) = asyncio.run(go())
    finally:
        engine.shutdown()
    assert out.finished and len(out.outputs) == 2
    expected = [s.tokens[12:] for s in offline.sequences[:2]]
    assert [o.token_ids for o in out.outputs] == expected
