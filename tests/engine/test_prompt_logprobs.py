"""prompt_logprobs (vLLM semantics) against transformers on a tiny model."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    from loramux.engine import LLM

    return LLM(str(tiny_model_dir), dtype="float32", max_model_len=128)


def test_prompt_logprobs_match_transformers(llm, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    from loramux.engine import SamplingParams

    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    outs = llm.generate(["The cat sat on the mat", "Hi", "One two three four five six"],
                        SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3))
    for out in outs:
        ids = out.prompt_token_ids
        with torch.no_grad():
            ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0], dim=-1)
        pl = out.prompt_logprobs
        assert len(pl) == len(ids) and pl[0] is None
        for j in range(1, len(ids)):
            entry = pl[j]
            assert entry[ids[j]].logprob == pytest.approx(ref[j - 1, ids[j]].item(), abs=1e-4)
            top = torch.topk(ref[j - 1], 3).indices.tolist()
            assert set(top) <= set(entry)
            assert entry[top[0]].rank == 1


def test_no_prompt_logprobs_by_default(llm):
    from loramux.engine import SamplingParams

    out = llm.generate(["Hello there"], SamplingParams(max_tokens=2))[0]
    assert out.prompt_logprobs is None

