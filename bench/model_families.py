"""Model families side by side: the default model (Llama), a tiny Qwen3 and a tiny Gemma 3.

For each model, two shapes (``bench/sweep.py``'s): ``uniform`` (all requests at once,
32-token prompts, 32 new tokens) and ``serving`` (Poisson arrivals, a shared prefix, longer
prompts), each with the base model and over 4 adapters (ranks 8/16, all 7 projections,
round-robin), on the engine's default path (fused small ops, the C attention kernel, the
LoRA SGMV kernel), after one warm-up run per model. Reports output tok/s, TTFT / TPOT p50,
output tokens per CPU-second (robust on a shared machine, with ``--threads 1``) and LoRA ÷
base per model and shape.
The Qwen3 and Gemma 3 models are random (``--hidden``, ``--layers``; the default tokenizer),
so their tokens are noise: only their speed means something. Gemma 3 has a sliding window
on 5 of every 6 layers (``--window``), so its attention runs twice per step's metadata.

The default model's rows are what must not regress: run this script with the interpreter
of another checkout (``--models default``) for its numbers on that code (the default model
and the engine's public API are all it uses there).

Writes bench/results/model_families.json and .png.

    python -m bench.model_families                      # ~5 minutes on 2 busy cores
    python -m bench.model_families --quick --models default,qwen3
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from bench.common import RESULTS, add_random_model_flags, bench_parser, setup, write_json
from bench.lora_throughput import make_adapters
from bench.sweep import sweep


def make_family_model(family: str, path: Path, tokenizer_dir: Path, args) -> Path:
    """A random ``family`` model (hidden ``args.hidden``, ``args.layers`` layers) saved as safetensors."""
    import transformers
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    heads = max(1, args.hidden // 64)
    common = dict(vocab_size=len(tok), hidden_size=args.hidden, intermediate_size=3 * args.hidden,
                  num_hidden_layers=args.layers, num_attention_heads=heads,
                  num_key_value_heads=max(1, heads // 2), head_dim=64, max_position_embeddings=2048,
                  bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=0,
                  tie_word_embeddings=True)
    if family == "qwen3":
        config, model_cls = transformers.Qwen3Config(**common), transformers.Qwen3ForCausalLM
    elif family == "gemma3":
        config = transformers.Gemma3TextConfig(**common, sliding_window=args.window, query_pre_attn_scalar=64)
        model_cls = transformers.Gemma3ForCausalLM
    else:
        raise ValueError(family)
    torch.manual_seed(0)
    model = model_cls(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02)
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    return path


def main() -> None:
    ap = bench_parser(__doc__, quick="half the requests, 16 new tokens", out="model_families")
    ap.add_argument("--models", default="default,qwen3,gemma3")
    ap.add_argument("--shapes", default="uniform,serving")
    add_random_model_flags(ap)
    ap.add_argument("--window", type=int, default=64)
    args = ap.parse_args()
    default, tok = setup(args)
    from loramux.engine.lora_request import LoRARequest

    results: dict[str, dict] = {}
    ratios: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            model = default if name == "default" else make_family_model(name, Path(tmp) / name, default, args)
            adapters = make_adapters(model, Path(tmp) / f"{name}-adapters", 4)
            loras = [LoRARequest(f"{name}-a{i}", i + 1, str(p)) for i, p in enumerate(adapters)]
            runs = sweep(model, tok, {"base": None, "lora": loras}, args.shapes.split(","), results,
                         dtype=args.dtype, quick=args.quick, label=f"{name}/")
            for shape, [r] in runs.items():
                b, lo = r["base"], r["lora"]
                ratios[f"{name}/{shape}: lora/base tok_s"] = lo["tok_s"] / b["tok_s"]
                ratios[f"{name}/{shape}: lora/base tok/cpu-s"] = lo["tok_per_cpu_s"] / b["tok_per_cpu_s"]
    for k, v in ratios.items():
        print(f"{k:34s} {v:5.2f}")
    out = write_json(args.out, {"args": vars(args), "results": results, "ratios": ratios})
    print(f"wrote {out}")
    _plot(results, args.out)


def _plot(results: dict, name: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    groups = sorted({k.rsplit("/", 1)[0] for k in results})
    fig, axes = plt.subplots(1, 2, figsize=(12, 3.8))
    width = 0.4
    for ax, metric, label in zip(axes, ("tok_s", "tpot_p50_ms"), ("output tok/s", "TPOT p50 (ms)"), strict=True):
        xs = range(len(groups))
        for j, kind in enumerate(("base", "lora")):
            ax.bar([x + j * width for x in xs], [results[f"{g}/{kind}"][metric] for g in groups], width,
                   label=kind, color=("#999", "#37a")[j])
        ax.set_xticks([x + width / 2 for x in xs], groups, rotation=30, ha="right")
        ax.set_title(label)
        ax.legend()
    fig.tight_layout()
    fig.savefig(RESULTS / f"{name}.png", dpi=100)


if __name__ == "__main__":
    main()
