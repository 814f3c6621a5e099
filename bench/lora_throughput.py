"""Multi-LoRA throughput: loramux with adapters vs loramux base vs PEFT (same run).

Workload (as bench/engine_throughput.py): 32 prompts of 32 tokens, 64 new tokens each,
greedy, the default model, float32, 2 threads, with 4 adapters (ranks 8 and 16, all 7
projections) assigned round-robin. Prints:

* loramux with LoRA / loramux base (goal >= 0.85);
* loramux with LoRA / PEFT grouped per adapter (``set_adapter``, one padded batch per
  adapter) (goal >= 3.0);
* scaling: 128 requests over 128 distinct adapters (4 consecutive requests share one),
  cycling through max_loras=8 and max_cpu_loras=32 (so most loads come from disk),
  ÷ the same 128 requests over 4 adapters (goal >= 0.7);
* cold start: time to first token for an adapter only on disk ÷ for a resident one.

Writes bench/results/lora_throughput.json.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench.common import (
    default_workload,
    make_prompts,
    peak_rss_mb,
    timed,
    workload_parser,
    write_json,
)

ALL_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapters(base_dir: Path, root: Path, count: int, ranks: tuple[int, ...] = (8, 16)) -> list[Path]:
    """``count`` random PEFT adapters (ranks cycle through ``ranks``) written without loading the base."""
    from loramux.adapters.format import LoraWeights, save_adapter
    from loramux.adapters.spec import LoraSpec
    from loramux.engine.model.weights import dims_from_config, read_hf_config

    dims = dims_from_config(read_hf_config(base_dir))
    shapes = dims.module_shapes()
    paths = []
    for i in range(count):
        r = ranks[i % len(ranks)]
        g = torch.Generator().manual_seed(i)
        layers = {
            layer: {
                m: (torch.randn(r, shapes[m][0], generator=g) * 0.02,
                    torch.randn(shapes[m][1], r, generator=g) * 0.02)
                for m in ALL_MODULES
            }
            for layer in range(dims.num_layers)
        }
        spec = LoraSpec(r=r, lora_alpha=2 * r, target_modules=tuple(ALL_MODULES),
                        base_model_name_or_path=str(base_dir))
        paths.append(save_adapter(LoraWeights(spec, layers), root / f"adapter-{i:03d}"))
    return paths


def loramux_tps(model, prompts, new_tokens, loras, **llm_kw) -> float:
    from loramux.engine import LLM, SamplingParams

    llm = LLM(str(model), dtype="float32", max_model_len=256, max_num_seqs=32, **llm_kw)
    params = SamplingParams(temperature=0, max_tokens=new_tokens, min_tokens=new_tokens, ignore_eos=True)
    warm = SamplingParams(temperature=0, max_tokens=2)
    # Steady state: the adapters that fit in the slots are resident before timing (cold
    # loads are measured on their own, below); with more adapters than slots, the rest
    # load during the run, as in production.
    first = list(dict.fromkeys(loras))[: llm_kw.get("max_loras", 0)] if loras else [None]
    llm.generate([{"prompt_token_ids": prompts[0]}] * len(first), warm, lora_request=first)
    reqs = [{"prompt_token_ids": p} for p in prompts]
    _, secs = timed(lambda: llm.generate(reqs, params, lora_request=loras))
    return len(prompts) * new_tokens / secs


def peft_tps(model, prompts, new_tokens, adapter_paths) -> float:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    peft = PeftModel.from_pretrained(base, adapter_paths[0], adapter_name="a0")
    for i, p in enumerate(adapter_paths[1:], start=1):
        peft.load_adapter(p, adapter_name=f"a{i}")
    peft.eval()
    groups = {i: [p for j, p in enumerate(prompts) if j % len(adapter_paths) == i] for i in range(len(adapter_paths))}
    kw = dict(do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0)
    t0 = time.perf_counter()
    with torch.inference_mode():
        for i, group in groups.items():
            peft.set_adapter(f"a{i}")
            ids = torch.tensor(group)
            peft.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **kw)
    return len(prompts) * new_tokens / (time.perf_counter() - t0)


def cold_start_ratio(model, adapter_paths, prompt) -> dict:
    from loramux.engine import LLM, LoRARequest, SamplingParams

    llm = LLM(str(model), dtype="float32", max_model_len=256, enable_lora=True, max_loras=2,
              max_lora_rank=16, max_cpu_loras=2)
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=1)

    def ttft(lora) -> float:
        t0 = time.perf_counter()
        engine.add_request(None, {"prompt_token_ids": prompt}, params, lora)
        while engine.has_unfinished_requests():
            engine.step_requests()
        return time.perf_counter() - t0

    resident = LoRARequest("resident", 1, str(adapter_paths[0]))
    ttft(resident)
    hot = statistics.median(ttft(resident) for _ in range(5))
    colds = []
    for i in range(5):
        lora = LoRARequest(f"cold-{i}", 100 + i, str(adapter_paths[1 + i % (len(adapter_paths) - 1)]))
        colds.append(ttft(lora))
    cold = statistics.median(colds)
    return {"ttft_resident_s": round(hot, 4), "ttft_disk_s": round(cold, 4), "ratio": round(cold / hot, 2)}


def main() -> None:
    ap = workload_parser(__doc__)
    ap.add_argument("--skip-scaling", action="store_true")
    args = ap.parse_args()
    from loramux.engine import LoRARequest

    model, tok, prompts = default_workload(args)
    tmp = Path(tempfile.mkdtemp(prefix="lora-bench-"))
    n_adapters = 4 if args.skip_scaling else 128
    paths = make_adapters(model, tmp, n_adapters)
    four = [LoRARequest(f"a{i}", i + 1, str(paths[i])) for i in range(4)]
    rr = [four[i % 4] for i in range(len(prompts))]
    lora_kw = dict(enable_lora=True, max_loras=4, max_lora_rank=16)

    base = loramux_tps(model, prompts, args.new_tokens, None)
    with_lora = loramux_tps(model, prompts, args.new_tokens, rr, **lora_kw)
    peft = peft_tps(model, prompts, args.new_tokens, [str(p) for p in paths[:4]])
    res = {
        "loramux_base_tokens_per_s": round(base, 1),
        "loramux_lora_tokens_per_s": round(with_lora, 1),
        "peft_grouped_tokens_per_s": round(peft, 1),
        "lora_over_base": round(with_lora / base, 3),
        "lora_over_peft": round(with_lora / peft, 2),
    }
    print(f"loramux base {base:.1f} tok/s, with 4 LoRAs {with_lora:.1f} tok/s -> "
          f"{with_lora / base:.2f}x of base (goal >= 0.85)")
    print(f"PEFT grouped {peft:.1f} tok/s -> loramux LoRA is {with_lora / peft:.2f}x PEFT (goal >= 3.0)")
    if not args.skip_scaling:
        many = make_prompts(tok, 128, args.prompt_len, seed=1)
        four_128 = [four[i % 4] for i in range(128)]
        cycle = [LoRARequest(f"c{i // 4}", 1000 + i // 4, str(paths[i // 4])) for i in range(128)]
        t4 = loramux_tps(model, many, args.new_tokens, four_128, **lora_kw)
        t128 = loramux_tps(model, many, args.new_tokens, cycle, enable_lora=True, max_loras=8,
                           max_lora_rank=16, max_cpu_loras=32)
        res.update({"scaling_4_adapters_tokens_per_s": round(t4, 1),
                    "scaling_128_adapters_tokens_per_s": round(t128, 1),
                    "scaling_ratio": round(t128 / t4, 3)})
        print(f"128 adapters through 8 slots {t128:.1f} tok/s vs 4 adapters {t4:.1f} tok/s -> "
              f"{t128 / t4:.2f}x (goal >= 0.7)")
    cold = cold_start_ratio(model, paths[:6], prompts[0])
    res["cold_start"] = cold
    print(f"time to first token: disk {cold['ttft_disk_s'] * 1e3:.0f} ms vs resident "
          f"{cold['ttft_resident_s'] * 1e3:.0f} ms -> {cold['ratio']:.1f}x")
    res["peak_rss_mb"] = round(peak_rss_mb(), 1)
    print(f"wrote {write_json('lora_throughput', {'workload': vars(args), 'results': res})}")


if __name__ == "__main__":
    main()
