"""More GPTQ checkpoints through the checks of ``test_gptq.py``: 8-bit groups of 16 with
``desc_act`` (not a multiple of 32: the torch path, the permutation undone in
``dequantize_rows``), Qwen3-MoE per-expert tensors (each expert the method's projection, the
router float) and a quantized ``lm_head`` (GPTQModel's ``lm_head=True``)."""

from __future__ import annotations

import pytest
from test_gptq import check_gptq

CASES = {  # name: (family, bits, group_size, write_gptq options)
    "llama-int8-g16-desc-act": ("llama", 8, 16, dict(desc_act=True)),  # torch path: 16 < 32
    "qwen3-moe-int4-g32-desc-act": ("qwen3_moe", 4, 32, dict(desc_act=True)),  # per-expert
    "phi3-int4-g32-lm-head": ("phi3", 4, 32, dict(lm_head=True)),  # GPTQModel's lm_head=True
}


@pytest.mark.parametrize("name", list(CASES))
def test_more_gptq_match_reference_dequantization(name, tmp_path, default_model_dir):
    check_gptq(CASES[name], tmp_path, default_model_dir)
