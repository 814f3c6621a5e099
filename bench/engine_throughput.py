"""Engine throughput vs Hugging Face transformers ``generate`` (same run, same machine).

Workload: 32 prompts of 32 tokens, 64 new tokens each (``min_tokens``/``ignore_eos``),
greedy, the default model, 2 threads; float32 and bfloat16. Prints tokens/s of both
and the ratio (goal: loramux >= 1.4x transformers), peak RSS, and writes
bench/results/engine_throughput.json.

    python -m bench.engine_throughput [--num-prompts 32] [--prompt-len 32] [--new-tokens 64]
"""

from __future__ import annotations

import gc

import torch

from bench.common import default_workload, peak_rss_mb, timed, workload_parser, write_json


def run_loramux(model_path, dtype, prompts, new_tokens) -> float:
    from loramux.engine import LLM, SamplingParams

    llm = LLM(str(model_path), dtype=dtype, max_model_len=512, max_num_seqs=len(prompts))
    params = SamplingParams(temperature=0, max_tokens=new_tokens, min_tokens=new_tokens, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in prompts[:2]], SamplingParams(temperature=0, max_tokens=4))
    outs, secs = timed(lambda: llm.generate([{"prompt_token_ids": p} for p in prompts], params))
    assert all(len(o.outputs[0].token_ids) == new_tokens for o in outs)
    gc.collect()
    return len(prompts) * new_tokens / secs


def run_transformers(model_path, dtype, prompts, new_tokens) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype)).eval()
    ids = torch.tensor(prompts)
    mask = torch.ones_like(ids)
    kw = dict(do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0)
    with torch.inference_mode():
        model.generate(ids[:2], attention_mask=mask[:2], **{**kw, "max_new_tokens": 4, "min_new_tokens": 4})
        out, secs = timed(lambda: model.generate(ids, attention_mask=mask, **kw))
    assert out.shape[1] == ids.shape[1] + new_tokens
    gc.collect()
    return len(prompts) * new_tokens / secs


def main() -> None:
    ap = workload_parser(__doc__)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    args = ap.parse_args()
    path, _, prompts = default_workload(args)
    results = {}
    for dtype in args.dtypes.split(","):
        # Alternate the order so neither side always runs on a warmer machine.
        hf = run_transformers(path, dtype, prompts, args.new_tokens)
        ours = run_loramux(path, dtype, prompts, args.new_tokens)
        hf2 = run_transformers(path, dtype, prompts, args.new_tokens)
        ours2 = run_loramux(path, dtype, prompts, args.new_tokens)
        hf_tps, our_tps = max(hf, hf2), max(ours, ours2)
        results[dtype] = {
            "loramux_tokens_per_s": round(our_tps, 1),
            "transformers_tokens_per_s": round(hf_tps, 1),
            "ratio": round(our_tps / hf_tps, 3),
            "goal_ratio": 1.4,
        }
        print(f"{dtype:9s} loramux {our_tps:7.1f} tok/s   transformers {hf_tps:7.1f} tok/s   "
              f"ratio {our_tps / hf_tps:.2f}x (goal >= 1.4x)")
    results["peak_rss_mb"] = round(peak_rss_mb(), 1)
    print(f"peak RSS {results['peak_rss_mb']:.0f} MiB")
    out = write_json("engine_throughput", {"workload": vars(args), "results": results})
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
