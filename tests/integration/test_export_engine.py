"""Export of the example adapter, served by the engine: the merged folder as a plain base
model gives the same greedy tokens as the default model + the adapter.

Tokens are compared under the near-tie rule (ARCHITECTURE.md, "Testing against the
references"): identical sequences pass; where they part, both must be argmaxes of the
merged Hugging Face model up to 2e-3 at every step, and the first difference must sit
at a near tie.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from support.greedy_reference import check_greedy

from loramux.adapters.merge import export_merged
from loramux.engine import LLM, LoRARequest, SamplingParams

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "adapters" / "sql-lora"
QUESTIONS = [
    "How many employees work in the Engineering department?",
    "List all customers from Italy.",
    "What is the total value of orders placed by customer 3?",
    "Write a short poem about autumn.",
]


@pytest.mark.e2e
def test_engine_merged_equals_base_plus_adapter(default_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    merged = export_merged(default_model_dir, EXAMPLE, tmp_path / "sql-merged", progress=False)
    tok = AutoTokenizer.from_pretrained(default_model_dir)
    prompts = [
        tok.apply_chat_template(
            [{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True
        )
        for q in QUESTIONS
    ]
    params = SamplingParams(temperature=0, max_tokens=16)

    llm = LLM(
        model=str(default_model_dir),
        dtype="float32",
        enable_lora=True,
        max_loras=2,
        max_lora_rank=16,
    )
    with_adapter = llm.generate(
        prompts, params, lora_request=LoRARequest("sql-lora", 1, str(EXAMPLE))
    )
    del llm
    llm = LLM(model=str(merged), dtype="float32")
    from_merged = llm.generate(prompts, params)
    del llm

    reference = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32).eval()
    for prompt, a, b in zip(prompts, with_adapter, from_merged, strict=True):
        lora_ids = list(a.outputs[0].token_ids)
        merged_ids = list(b.outputs[0].token_ids)
        if lora_ids == merged_ids:
            continue
        prompt_ids = tok(prompt, add_special_tokens=False)["input_ids"]
        check_greedy(reference, prompt_ids, merged_ids)
        check_greedy(reference, prompt_ids, lora_ids, reference_ids=merged_ids)
    # the adapter is active: the SQL questions are answered in SQL
    for out in with_adapter[:3]:
        assert out.outputs[0].text.strip().upper().startswith("SELECT"), out.outputs[0].text
