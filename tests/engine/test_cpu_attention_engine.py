"""The engine on both CPU attention paths (the C kernel, the torch path) and both small-op
paths (fused kernels, ``enforce_eager``) against transformers by teacher forcing, with
chunked prompts continuing a cached prefix."""

from __future__ import annotations

import pytest
from support.cpu_kernel import require_cpu_kernel
from support.lora_fixtures import peft_reference, teacher_forcing_gaps

from loramux.engine import LLM, SamplingParams

TOL = 2e-3


@pytest.mark.parametrize("backend,eager", [("auto", False), ("auto", True), ("torch", True)])
def test_both_attention_paths_match_transformers(tiny_model_dir, backend, eager):
    if backend == "auto" or not eager:
        require_cpu_kernel()
    llm = LLM(str(tiny_model_dir), dtype="float32", max_model_len=256, max_num_batched_tokens=24,
              attention_backend=backend, enforce_eager=eager)
    assert llm.llm_engine.runner.cpu_kernel == (backend == "auto")
    assert llm.llm_engine.model.ops.name == ("eager" if eager else "fused")
    prefix = list(range(1000, 1040))  # shared: later prompts continue its cached blocks
    prompts = [{"prompt_token_ids": prefix + list(range(2000 + 50 * i, 2013 + 50 * i + i))} for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    llm.generate(prompts[:1], params)  # the prefix is cached before the batch
    outs = llm.generate(prompts, params)
    ref = peft_reference(tiny_model_dir, None)
    for out in outs:
        gaps, _ = teacher_forcing_gaps(ref, out.prompt_token_ids, out.outputs[0].token_ids)
        assert max(gaps) <= TOL, (out.request_id, gaps)
