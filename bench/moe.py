"""A tiny mixture-of-experts base (random Qwen3-MoE) with LoRA on attention and on the experts.

Three runs of the same workload (``bench/sweep.py``'s ``uniform`` and ``serving`` shapes,
after one warm-up run): the base model; 4 attention-only adapters (q/k/v/o, ranks 8/16,
round-robin); 4 adapters with the same attention LoRA plus LoRA on every expert's
``gate_up_proj`` and ``down_proj`` (PEFT's ``target_parameters``). Reports output tok/s,
TTFT / TPOT p50, output tokens per CPU-second (robust on a shared machine, with
``--threads 1``) and each LoRA run ÷ the base run, measured in the same process: the
number to watch is ``experts/base`` (the issue's goal: ≥ 0.75 on the CPU).

The model's tokens are noise (random weights, the default tokenizer): only its speed means
something. Writes bench/results/moe.json and .png.

    python -m bench.moe                 # a few minutes on 2 busy cores
    python -m bench.moe --quick --threads 1
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from bench.common import RESULTS, add_random_model_flags, bench_parser, setup, write_json
from bench.sweep import sweep

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
    ap = bench_parser(__doc__, quick="the uniform shape only, 8 requests, 16 new tokens", out="moe")
    ap.add_argument("--shapes", default="uniform,serving")
    add_random_model_flags(ap, layers=6)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--expert-size", type=int, default=384)
    args = ap.parse_args()
    default, tok = setup(args)
    from loramux.engine.lora_request import LoRARequest

    results: dict[str, dict] = {}
    ratios: dict[str, float] = {}
    shapes = ["uniform"] if args.quick else args.shapes.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        model = make_moe_model(Path(tmp) / "moe", default, args)
        kinds = {"base": None}
        for kind, experts in (("attention", False), ("experts", True)):
            paths = make_adapters(model, Path(tmp) / kind, 4, experts=experts)
            kinds[kind] = [LoRARequest(f"{kind}-{i}", 10 * experts + i + 1, str(p)) for i, p in enumerate(paths)]
        runs = sweep(model, tok, kinds, shapes, results, dtype=args.dtype, quick=args.quick,
                     warm=["experts"])
        for shape, [r] in runs.items():
            for kind in ("attention", "experts"):
                ratios[f"{shape}: {kind}/base tok_s"] = r[kind]["tok_s"] / r["base"]["tok_s"]
                ratios[f"{shape}: {kind}/base tok/cpu-s"] = r[kind]["tok_per_cpu_s"] / r["base"]["tok_per_cpu_s"]
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
