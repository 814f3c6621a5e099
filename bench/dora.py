"""DoRA ÷ plain LoRA throughput in the one continuous batch (goal ≥ 0.95).

Four adapters (ranks 8/16, all 7 projections, round-robin over the requests), once as plain
LoRA and once as DoRA with the same A and B plus a magnitude per output feature (the base's
``‖W0 + s·BA‖`` moved by a few percent), on ``bench/sweep.py``'s two shapes:
``uniform`` (all requests at once, 32-token prompts) and ``serving`` (Poisson arrivals, a
shared prefix, longer prompts). The default model on the engine's default path; with
``--models default,qwen3`` a random Qwen3 too. LoRA and DoRA runs alternate (``--repeats``
pairs, each in the other order than the last) and each ratio is the median over the pairs,
with output tokens per CPU-second beside wall-clock tok/s (``--threads 1``). Last, the
steadiest number on a shared machine: the CPU time of one decode step of 16 rows over the 4
adapters, the minimum over ``--step-repeats`` alternating measurements of 8 steps each
(``decode_step``).

Writes bench/results/dora.json and .png.

    python -m bench.dora                 # ~4 minutes on 2 busy cores
    python -m bench.dora --quick --threads 1
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import tempfile
from pathlib import Path

import torch

from bench.common import (
    RESULTS,
    add_random_model_flags,
    bench_parser,
    make_engine,
    setup,
    write_json,
)
from bench.lora_throughput import make_adapters
from bench.model_families import make_family_model
from bench.sweep import sweep


def _base_weights(model: Path):
    """``name -> tensor`` reader over the base folder's safetensors."""
    from safetensors import safe_open

    index = model / "model.safetensors.index.json"
    where = json.loads(index.read_text())["weight_map"] if index.is_file() else None

    def get(name: str) -> torch.Tensor:
        with safe_open(str(model / (where[name] if where else "model.safetensors")), "pt") as f:
            return f.get_tensor(name).float()

    return get


def make_dora(plain: list[Path], model: Path, root: Path) -> list[Path]:
    """The plain adapters again as DoRA: the same A/B, magnitudes ``‖W0 + s·BA‖ · (1 + 0.05 N)``."""
    from loramux.adapters.arch import MODULE_PARENT
    from loramux.adapters.format import load_adapter, save_adapter

    get = _base_weights(model)
    out = []
    for i, path in enumerate(plain):
        w = load_adapter(path)
        s = w.spec.scale
        g = torch.Generator().manual_seed(100 + i)
        mags: dict[int, dict[str, torch.Tensor]] = {}
        for layer, modules in w.layers.items():
            for module, (a, b) in modules.items():
                w0 = get(f"model.layers.{layer}.{MODULE_PARENT[module]}.{module}.weight")
                norm = torch.linalg.vector_norm(w0 + s * (b @ a), dim=1)
                mags.setdefault(layer, {})[module] = norm * (1 + 0.05 * torch.randn(norm.shape, generator=g))
        w.magnitudes = mags
        w.spec = dataclasses.replace(w.spec, use_dora=True)
        out.append(save_adapter(w, root / f"dora-{i:03d}"))
    return out


def decode_step_ms(model, kinds: dict, dtype: str, repeats: int) -> dict[str, float]:
    """Minimum CPU ms of one decode step (16 rows, round-robin over each kind's adapters),
    the kinds measured alternately ``repeats`` times."""
    import time

    from loramux.engine.sampling_params import SamplingParams

    engines = {kind: make_engine(model=str(model), dtype=dtype, max_model_len=512, max_num_seqs=64,
                                 enable_lora=True, max_loras=len(loras))
               for kind, loras in kinds.items()}
    best = dict.fromkeys(kinds, float("inf"))
    params = SamplingParams(temperature=0, max_tokens=24, min_tokens=24, ignore_eos=True)
    for rep in range(repeats + 1):  # the first round warms up (loads, oneDNN primitives)
        for kind, loras in kinds.items():
            eng = engines[kind]
            for i in range(16):
                eng.add_request(f"{rep}-{i}", {"prompt_token_ids": list(range(1000 + i, 1032 + i))},
                                params, lora_request=loras[i % len(loras)])
            for _ in range(4):  # prefill, first decodes
                eng.step()
            t = time.process_time()
            for _ in range(8):
                eng.step()
            if rep:
                best[kind] = min(best[kind], (time.process_time() - t) / 8 * 1e3)
            while eng.has_unfinished_requests():
                eng.step()
    return best


def main() -> None:
    ap = bench_parser(__doc__, quick="half the requests, 16 new tokens", out="dora")
    ap.add_argument("--models", default="default")
    ap.add_argument("--shapes", default="uniform,serving")
    ap.add_argument("--repeats", type=int, default=2, help="LoRA/DoRA run pairs per shape")
    add_random_model_flags(ap)
    ap.add_argument("--window", type=int, default=64)
    ap.add_argument("--step-repeats", type=int, default=5)
    args = ap.parse_args()
    default, tok = setup(args)
    from loramux.engine.lora_request import LoRARequest

    results: dict[str, dict] = {}
    ratios: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            model = default if name == "default" else make_family_model(name, Path(tmp) / name, default, args)
            plain = make_adapters(model, Path(tmp) / f"{name}-lora", 4)
            dora = make_dora(plain, model, Path(tmp) / f"{name}-dora")
            kinds = {
                "lora": [LoRARequest(f"{name}-l{i}", i + 1, str(p)) for i, p in enumerate(plain)],
                "dora": [LoRARequest(f"{name}-d{i}", i + 1, str(p)) for i, p in enumerate(dora)],
            }
            runs = sweep(model, tok, kinds, args.shapes.split(","), results, dtype=args.dtype,
                         quick=args.quick, label=f"{name}/", pairs=args.repeats)
            for shape, pairs in runs.items():
                for metric in ("tok_s", "tok_per_cpu_s"):
                    ratios[f"{name}/{shape}: dora/lora {metric}"] = statistics.median(
                        p["dora"][metric] / p["lora"][metric] for p in pairs)
            if args.step_repeats:
                ms = decode_step_ms(model, kinds, args.dtype, args.step_repeats)
                results[f"{name}/decode_step_ms"] = ms
                print(f"{name}/decode step: lora {ms['lora']:.1f} ms, dora {ms['dora']:.1f} ms", flush=True)
                ratios[f"{name}/decode_step: lora/dora time"] = ms["lora"] / ms["dora"]
    for k, v in ratios.items():
        print(f"{k:38s} {v:5.3f}")
    out = write_json(args.out, {"args": vars(args), "results": results, "ratios": ratios,
                                "goal": "dora/lora >= 0.95"})
    print(f"wrote {out}")
    _plot(ratios, args.out)


def _plot(ratios: dict, name: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    labels = list(ratios)
    fig, ax = plt.subplots(figsize=(8, 3.5))
    ax.barh(range(len(labels)), [ratios[k] for k in labels], color="#37a")
    ax.axvline(0.95, color="#c33", ls="--", label="goal 0.95")
    ax.axvline(1.0, color="#999", lw=0.8)
    ax.set_yticks(range(len(labels)), labels)
    ax.set_xlim(0.5, 1.2)
    ax.set_xlabel("DoRA ÷ plain LoRA (same A/B, same workload)")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(RESULTS / f"{name}.png", dpi=100)


if __name__ == "__main__":
    main()
