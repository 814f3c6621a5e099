"""Numbers are isolated between the rows of a step (tiny model, fast).

A poisoned adapter (finite but huge ``lora_B``) turns its own sequence's hidden state and
KV into NaN/Inf. That sequence is forced into cache slot 0 (the first blocks a fresh pool
hands out), then other tenants' rows of different lengths decode beside the poisoned
cache: their greedy outputs equal their outputs alone, the poisoned request fails with
:class:`AdapterNumericsError`, and the adapter is marked broken until replaced.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file
from support.adapters import write_random_adapter

PROMPTS = ["Hi", "The quick brown fox jumps over", "Once upon a time in a land far away there"]


def _llm(tiny_model_dir):
    from loramux.engine import LLM

    return LLM(str(tiny_model_dir), dtype="float32", max_model_len=128, enable_lora=True,
               max_lora_rank=8, max_loras=2, enable_prefix_caching=False)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, tiny_model_dir):
    root = tmp_path_factory.mktemp("numerics")
    good = write_random_adapter(tiny_model_dir, root / "good", r=4, seed=1, std=0.2,
                                target_modules=("q_proj", "k_proj", "v_proj", "o_proj"))
    bad = write_random_adapter(tiny_model_dir, root / "bad", r=4, seed=2, std=0.2,
                               target_modules=("q_proj", "k_proj", "v_proj", "o_proj"))
    weights = bad / "adapter_model.safetensors"
    tensors = {k: v * 1e30 if "lora_B" in k else v for k, v in load_file(weights).items()}
    save_file(tensors, weights)  # finite, so only the serving-time check can catch it
    return good, bad


def _warm(engine, key: str) -> None:
    for _ in range(2000):
        if engine.lora_manager.warm(key):
            return
        engine.lora_manager.poll(wait=0.01)
    raise AssertionError(f"adapter {key} never loaded")


def test_poisoned_slot_zero_does_not_reach_other_rows(tiny_model_dir, adapters):
    from loramux.engine import LoRARequest, SamplingParams
    from loramux.engine.engine import AdapterNumericsError
    from loramux.engine.lora.manager import AdapterBrokenError

    good_dir, bad_dir = adapters
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    good = LoRARequest("good", 1, str(good_dir))
    bad = LoRARequest("bad", 2, str(bad_dir))
    loras = [None, good, None]
    alone = [_llm(tiny_model_dir).generate([p], greedy, lora_request=lora)[0].outputs[0].token_ids
             for p, lora in zip(PROMPTS, loras, strict=True)]

    llm = _llm(tiny_model_dir)
    engine = llm.llm_engine
    events = []
    engine.lora_manager.add_listener(lambda event, key: events.append((event, key)))
    engine.lora_manager.register(bad)
    _warm(engine, "bad")
    engine.add_request("poison", "Poison " * 20, greedy, bad, fairness_key="mallory")
    assert engine.scheduler.waiting[0].block_table == []
    (failed,) = engine.step_requests()
    assert failed.request_id == "poison" and isinstance(failed.error, AdapterNumericsError)
    assert "'bad'" in str(failed.error) and failed.error.adapter == "bad"
    k_cache = engine.runner.kv_caches[-1][0]
    assert not torch.isfinite(k_cache[0]).all()  # slot 0 holds the poisoned sequence's keys
    assert ("broken", "bad") in events
    with pytest.raises(AdapterBrokenError, match="marked broken"):
        engine.add_request("again", "Hello", greedy, bad)

    for i, (prompt, lora) in enumerate(zip(PROMPTS, loras, strict=True)):
        engine.add_request(f"r{i}", prompt, greedy, lora, fairness_key=f"tenant{i}")
    done = {}
    while engine.has_unfinished_requests():
        for req in engine.step_requests():
            assert req.error is None, req.error
            if req.finished:
                done[req.request_id] = req.to_output().outputs[0].token_ids
    assert [done[f"r{i}"] for i in range(3)] == alone
    assert "bad" not in engine.lora_manager.slot_of  # evicted
    # replaced (another path under the name): served again
    engine.add_request("fixed", "Hello", greedy, LoRARequest("bad", 3, str(good_dir)))
