"""A hostile tenant's module copies (``modules_to_save`` norms, a full embedding copy) with finite
but huge values: its own requests fail with ``AdapterNumericsError`` (their hidden states
overflow), while the base model's and another tenant's rows in the same steps give exactly
their outputs alone."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file
from support.lora_fixtures import make_peft_adapter

PROMPTS = ["Hi there", "The quick brown fox jumps over", "Once upon a time in a land far away"]


def _llm(base):
    from loramux.engine import LLM

    return LLM(str(base), dtype="float32", max_model_len=128, enable_lora=True, max_lora_rank=8,
               max_loras=3, enable_prefix_caching=False)


def _poison(adapter, match, rows=None):
    path = adapter / "adapter_model.safetensors"
    sd = load_file(path)
    for k, v in sd.items():
        if match in k and "lora_" not in k:
            if rows is None:
                v.fill_(1e30)
            else:
                v[rows] = 1e30
    save_file(sd, str(path), metadata={"format": "pt"})
    return adapter


@pytest.mark.parametrize("kind", ["norms", "embedding"])
def test_poisoned_copies_stay_in_their_rows(kind, tmp_path, tiny_model_dir):
    from loramux.engine import LoRARequest, SamplingParams
    from loramux.engine.engine import AdapterNumericsError

    good = make_peft_adapter(tiny_model_dir, tmp_path / "good", target_modules=["q_proj"], std=0.2)
    if kind == "norms":
        bad = _poison(make_peft_adapter(tiny_model_dir, tmp_path / "bad", target_modules=["q_proj"],
                                        modules_to_save=["norm"]), "norm.weight")
    else:
        bad = make_peft_adapter(tiny_model_dir, tmp_path / "bad", target_modules=["q_proj"],
                                modules_to_save=["embed_tokens"])
        ids = torch.arange(0, 2000)  # every token the prompts may hold below 2000
        _poison(bad, "embed_tokens.weight", ids)
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    loras = [None, LoRARequest("good", 1, str(good)), None]
    llm = _llm(tiny_model_dir)
    alone = [llm.generate([p], greedy, lora_request=lora)[0].outputs[0].token_ids
             for p, lora in zip(PROMPTS, loras, strict=True)]
    engine = llm.llm_engine
    engine.add_request("poison", "Poison " * 10, greedy, LoRARequest("bad", 2, str(bad)),
                       fairness_key="mallory")
    for i, (prompt, lora) in enumerate(zip(PROMPTS, loras, strict=True)):
        engine.add_request(f"r{i}", prompt, greedy, lora, fairness_key=f"tenant{i}")
    done, failed = {}, {}
    while engine.has_unfinished_requests():
        for req in engine.step_requests():
            if req.error is not None:
                failed[req.request_id] = req.error
            elif req.finished:
                done[req.request_id] = req.to_output().outputs[0].token_ids
    assert isinstance(failed.get("poison"), AdapterNumericsError), failed
    assert [done[f"r{i}"] for i in range(3)] == alone
