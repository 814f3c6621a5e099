"""32 tiny adapters (ranks 2-64, mixed targets) over 2 slots and over the derived
capacity: interleaved greedy requests equal each adapter alone under PEFT (teacher-forced)."""

from __future__ import annotations

import pytest
from support.lora_fixtures import (
    ALL_MODULES,
    make_peft_adapter,
    peft_reference,
    teacher_forcing_gaps,
)

RANKS = [2, 4, 8, 16, 32, 64]
TARGETS = [ALL_MODULES, ["q_proj", "v_proj"], ["o_proj", "gate_proj", "down_proj"]]
N = 32


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, tiny_model_dir):
    root = tmp_path_factory.mktemp("many-adapters")
    return [
        make_peft_adapter(tiny_model_dir, root / f"m{i}", r=RANKS[i % len(RANKS)],
                          target_modules=TARGETS[i % len(TARGETS)], seed=500 + i, std=0.15)
        for i in range(N)
    ]


@pytest.fixture(scope="module")
def references(tiny_model_dir, adapters):
    """One PEFT model holding all 32 adapters; ``ref(i)`` switches to adapter i."""
    model = peft_reference(tiny_model_dir, adapters[0])  # PEFT names it "default"
    names = {0: "default"}

    def ref(i: int):
        if i not in names:
            names[i] = f"m{i}"
            model.load_adapter(str(adapters[i]), adapter_name=names[i])
        model.set_adapter(names[i])
        return model

    return ref


@pytest.mark.parametrize("max_loras", [2, None], ids=["2-slots", "derived"])
def test_interleaved_requests_over_few_slots_equal_peft(tiny_model_dir, adapters, references,
                                                        max_loras):
    from loramux.engine import LLM, LoRARequest, SamplingParams

    llm = LLM(str(tiny_model_dir), dtype="float32", max_model_len=128, enable_lora=True,
              max_lora_rank=64, max_loras=max_loras, max_cpu_loras=4 if max_loras else None)
    # interleaved: consecutive requests use different adapters (every one twice when the
    # slots hold them all; once over two slots, where each hand-over costs steps)
    order = [(7 * j) % N for j in range(N if max_loras else 2 * N)]
    prompts = [f"Request {j} for adapter {i} says" for j, i in enumerate(order)]
    loras = [LoRARequest(f"m{i}", i + 1, str(adapters[i])) for i in order]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4), lora_request=loras)
    manager = llm.llm_engine.lora_manager
    stats = manager.load_stats
    if max_loras == 2:
        assert manager.max_loras == 2 and len(manager.slot_of) <= 2
        assert manager.num_evictions >= N - 2  # every adapter passed through the two slots
    else:
        assert manager.max_loras >= N and manager.num_evictions == 0
    assert stats.loads["disk"] >= N and stats.loads["cpu"] >= N
    for i, lora, out in zip(order, loras, outs, strict=True):
        assert out.outputs[0].token_ids, lora.lora_name
        gaps, _ = teacher_forcing_gaps(references(i), out.prompt_token_ids,
                                       out.outputs[0].token_ids)
        assert max(gaps) <= 2e-3, (lora.lora_name, gaps)
