"""MoE experts of a quantized checkpoint (Qwen3-MoE, compressed-tensors int4 per-expert tensors as
llm-compressor writes them: ``mlp.experts.<e>.<gate|up|down>_proj.weight_packed``): each expert
is the quantization method's projection (the router and attention float), teacher-forced
against transformers running the same experts dequantized by the compressed-tensors library, a
plain LoRA on top against PEFT over that dequantized base, base rows beside it."""

from __future__ import annotations

from ct_moe_checkpoint import write_int4_experts
from support.lora_fixtures import make_peft_adapter
from support.peft_harness import check_rows_match_peft, peft_prompts
from support.tiny_models import make_tiny_model

from loramux.engine import LLM, LoRARequest, SamplingParams


def test_quantized_experts_match_the_dequantized_reference(tmp_path, default_model_dir):
    src = make_tiny_model(tmp_path / "float", default_model_dir, "qwen3_moe")
    write_int4_experts(src, tmp_path / "quant", tmp_path / "ref")
    prompts = peft_prompts(default_model_dir, 8)[:3]
    adapter = make_peft_adapter(tmp_path / "ref", tmp_path / "a", r=4, target_modules=["q_proj", "o_proj"],
                                std=0.1)
    llm = LLM(str(tmp_path / "quant"), dtype="float32", device="cpu", max_model_len=128, enable_lora=True,
              max_loras=1, max_lora_rank=8)
    model = llm.llm_engine.model
    experts = model.layers[0].mlp
    assert type(experts.gate_up[0]).__name__ == "QuantLinear" and len(experts.gate_up) == 8
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts + prompts[:1]], params,
                        lora_request=[None, LoRARequest("a", 1, str(adapter)), None,
                                      LoRARequest("a", 1, str(adapter))])
    check_rows_match_peft(tmp_path / "ref", [adapter], prompts + prompts[:1], [None, 0, None, 0], outs,
                          against_base=False)
    # the experts take their packed bytes (int4 + a scale per 16), not float32's
    float_bytes = 8 * 3 * 32 * 64 * 4
    assert sum(x.nbytes for x in experts.gate_up + experts.down) < float_bytes / 4
