"""A tiny mixture-of-experts base (random Qwen3-MoE) with LoRA on attention and on the experts.

Three runs of the same workload (``bench/fast_step.py``'s ``uniform`` and ``serving`` shapes,
after one warm-up run): the base model; 4 attention-only adapters (q/k/v/o, ranks 8/16,
round-robin); 4 adapters with the same attention LoRA plus LoRA on every expert's
``gate_up_proj`` and ``down_proj`` (PEFT's ``target_parameters``). Reports output tok/s,
TTFT / TPOT p50, output tokens per CPU-second (robust on a shared machine, with
``--threads 1``) and each LoRA run ÷ the base run, measured in the same process: the
number to watch is ``experts/base`` (the issue's goal: ≥ 0.75 on the CPU).

The model's tokens are noise (random weights, the default tokenizer): only its speed means
something. Writes bench/results/moe.json and .png.

    python bench/moe.py                 # a few minutes on 2 busy cores
    python bench/moe.py --quick --threads 1
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, write_json  # noqa: E402
from fast_step import make_workload, run  # noqa: E402

SHAPES = {
    "uniform": dict(num_prompts=16, rate=1e9, prefix_len=0, min_len=32, max_len=32, new_tokens=32),
    "serving": dict(num_prompts=12, rate=1.5, prefix_len=96, min_len=100, max_len=200, new_tokens=24),
}
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")


def make_moe_model(path: Path, tokenizer_dir: Path, args) -> Path:
    """A random Qwen3-MoE (``--hidden``, ``--layers``, ``--experts``, ``--top-k``) as safetensors."""
    import transformers
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    heads = max(1, args.hidden // 64)
    config = transformers.Qwen3MoeConfig(
        vocab_size=len(tok), hidden_size=args.hidden, intermediate_size=3 * args.hidden,
        moe_intermediate_size=args.expert_size, num_experts=args.experts, num_experts_per_tok=args.top_k,
        norm_topk_prob=True, num_hidden_layers=args.layers, num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2), head_dim=64, max_position_embeddings=2048,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=0,
        tie_word_embeddings=True)
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02)
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    return path


def make_adapters(base_dir: Path, root: Path, count: int, *, experts: bool) -> list[Path]:
    """``count`` random adapters (ranks 8/16) on attention, and on every expert when ``experts``."""
    from loramux.adapters.experts import EXPERT_PARAMS, expert_shapes
    from loramux.adapters.format import LoraWeights, save_adapter
    from loramux.adapters.spec import LoraSpec
    from loramux.engine.model.weights import dims_from_config, read_hf_config

    dims = dims_from_config(read_hf_config(base_dir))
    shapes, eshapes = dims.module_shapes(), expert_shapes(dims)
    paths = []
    for i in range(count):
        r = 8 if i % 2 == 0 else 16
        g = torch.Generator().manual_seed(i)

        def rand(*shape, g=g):
            return torch.randn(*shape, generator=g) * 0.02

        layers = {layer: {m: (rand(r, shapes[m][0]), rand(shapes[m][1], r)) for m in ATTENTION}
                  for layer in range(dims.num_layers)}
        params = EXPERT_PARAMS if experts else ()
        moe = {layer: {p: (rand(dims.num_experts, r, eshapes[p][0]), rand(dims.num_experts, eshapes[p][1], r))
                       for p in params} for layer in dims.moe_layers} if experts else {}
        spec = LoraSpec(r=r, lora_alpha=2 * r, target_modules=ATTENTION, base_model_name_or_path=str(base_dir),
                        target_parameters=params, parameter_ranks=tuple((p, r, 2.0 * r) for p in params))
        paths.append(save_adapter(LoraWeights(spec, layers, experts=moe), root / f"adapter-{i:03d}"))
    return paths


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="uniform,serving")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--expert-size", type=int, default=384)
    ap.add_argument("--quick", action="store_true", help="the uniform shape only, 8 requests, 16 new tokens")
    ap.add_argument("--out", default="moe", help="results name (bench/results/<out>.*)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    from loramux.engine.default_model import default_model_path
    from loramux.engine.lora_request import LoRARequest

    default = default_model_path()
    tok = AutoTokenizer.from_pretrained(default)
    results: dict[str, dict] = {}
    ratios: dict[str, float] = {}
    shapes = ["uniform"] if args.quick else args.shapes.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        model = make_moe_model(Path(tmp) / "moe", default, args)
        kinds = {"base": None}
        for kind, experts in (("attention", False), ("experts", True)):
            paths = make_adapters(model, Path(tmp) / kind, 4, experts=experts)
            kinds[kind] = [LoRARequest(f"{kind}-{i}", 10 * experts + i + 1, str(p)) for i, p in enumerate(paths)]
        warm = argparse.Namespace(**SHAPES["uniform"], dtype=args.dtype)
        warm.num_prompts, warm.new_tokens = 4, 4
        run(model, *make_workload(tok, warm), kinds["experts"], warm, False)  # oneDNN primitives, kernels
        for shape in shapes:
            wl = argparse.Namespace(**SHAPES[shape], dtype=args.dtype)
            if args.quick:
                wl.num_prompts, wl.new_tokens = 8, 16
            prompts, arrivals = make_workload(tok, wl)
            for kind, loras in kinds.items():
                key = f"{shape}/{kind}"
                results[key] = r = run(model, prompts, arrivals, loras, wl, False)
                print(f"{key:20s} {r['tok_s']:7.1f} tok/s  TTFT p50 {r['ttft_p50_ms']:7.1f} ms  "
                      f"TPOT p50 {r['tpot_p50_ms']:6.1f} ms  {r['tok_per_cpu_s']:6.1f} tok/cpu-s", flush=True)
            b = results[f"{shape}/base"]
            for kind in ("attention", "experts"):
                lo = results[f"{shape}/{kind}"]
                ratios[f"{shape}: {kind}/base tok_s"] = lo["tok_s"] / b["tok_s"]
                ratios[f"{shape}: {kind}/base tok/cpu-s"] = lo["tok_per_cpu_s"] / b["tok_per_cpu_s"]
    for k, v in ratios.items():
        print(f"{k:36s} {v:5.2f}")
    out = write_json(args.out, {"args": vars(args), "results": results, "ratios": ratios})
    print(f"wrote {out}")
    _plot(results, ratios, args.out)


def _plot(results: dict, ratios: dict, name: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    shapes = sorted({k.split("/")[0] for k in results})
    kinds = ("base", "attention", "experts")
    fig, axes = plt.subplots(1, 2, figsize=(12, 3.8))
    width = 0.27
    for ax, metric, label in zip(axes, ("tok_s", "tpot_p50_ms"), ("output tok/s", "TPOT p50 (ms)"), strict=True):
        for j, kind in enumerate(kinds):
            ax.bar([x + j * width for x in range(len(shapes))], [results[f"{s}/{kind}"][metric] for s in shapes],
                   width, label=kind, color=("#999", "#7a3", "#37a")[j])
        ax.set_xticks([x + width for x in range(len(shapes))], shapes)
        ax.set_title(label)
        ax.legend()
    ratio = "  ".join(f"{s}: experts/base {ratios[f'{s}: experts/base tok_s']:.2f}" for s in shapes)
    fig.suptitle(f"tiny Qwen3-MoE, 4 adapters per LoRA run ({ratio})")
    fig.tight_layout()
    fig.savefig(RESULTS / f"{name}.png", dpi=100)


if __name__ == "__main__":
    main()
