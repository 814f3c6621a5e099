"""Adapters with vocabulary parts against the same adapters without them: offline
``LLM.generate`` throughput over one mixed batch, and a one-row decode step.

Four random PEFT adapters (rank 16, the 7 projections; made by PEFT itself, ``get_peft_model``
then random A/B, saved with ``save_embedding_layers=False``) serve a batch of ``--prompts``
prompts of mixed lengths (16-300 tokens, 32-48 new tokens each, greedy), the rows spread over
the adapters. Run A: the four adapters as plain LoRA (their vocabulary parts dropped). Run B:
the same adapters with their vocabulary parts: two with trainable tokens (8 ids the prompts
hold, the base's tied embeddings, so the logits' columns too), one with ``embed_tokens`` LoRA,
one with ``lm_head`` LoRA. Both sets sit on one engine (prefix caching off: every run computes
its prompts); A and B alternate (``--runs`` each,
after a warm-up of each); the medians and B/A (goal >= 0.95) are reported per dtype (float32,
and bfloat16 where the CPU has AVX512-BF16). The one-row decode step: one prompt, each of the
four adapters in turn, (time of ``--step-tokens`` new tokens - time of 1) / (n - 1). When B/A is
under 0.95 one B run is profiled (torch.profiler; ``VocabStep.embed``/``head`` wrapped in
``record_function`` by this script) and the breakdown is written too (``--profile``: always).
Writes bench/results/vocab_adapters.json and .png.

    python -m bench.vocab_adapters [--quick] [--runs 3] [--dtypes float32,bfloat16] [--profile]
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench.common import (
    RESULTS,
    bench_parser,
    cpu_name,
    has_avx512_bf16,
    peak_rss_mb,
    setup,
    write_json,
)

PROJ = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
GOAL = 0.95



def make_prompts(tok, num: int, seed: int = 5) -> tuple[list[list[int]], list[int]]:
    """``num`` prompts of ordinary text tokens, lengths 16-300 (spread), and 32-48 new tokens each."""
    g = torch.Generator().manual_seed(seed)
    lo, hi = 1000, min(len(tok), 40000)
    lens = torch.linspace(16, 300, num).round().long()[torch.randperm(num, generator=g)].tolist()
    prompts = [torch.randint(lo, hi, (n,), generator=g).tolist() for n in lens]
    new = torch.randint(32, 49, (num,), generator=g).tolist()
    return prompts, new


def make_adapters(model: Path, root: Path, token_ids: list[list[int]]) -> tuple[list[Path], list[Path]]:
    """(B: the four adapters with vocabulary parts, A: the same without them)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from loramux.adapters.format import load_adapter
    from loramux.adapters.weights import save_adapter

    extras = [dict(trainable_token_indices=token_ids[0]),
              dict(trainable_token_indices=token_ids[1]),
              dict(target_modules=PROJ + ["embed_tokens"]),
              dict(target_modules=PROJ + ["lm_head"])]
    names = ["tokens0", "tokens1", "embed_lora", "head_lora"]
    with_parts, plain = [], []
    for i, extra in enumerate(extras):
        base = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
        cfg = LoraConfig(task_type="CAUSAL_LM", r=16, lora_alpha=32, init_lora_weights=False,
                         lora_dropout=0.0, **{"target_modules": PROJ, **extra})
        torch.manual_seed(i)
        peft_model = get_peft_model(base, cfg)
        g = torch.Generator().manual_seed(100 + i)
        with torch.no_grad():
            for name, p in peft_model.named_parameters():
                if "lora_" in name or "trainable_tokens_delta" in name:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.02)
        out = root / f"B-{names[i]}"
        peft_model.save_pretrained(out, safe_serialization=True, save_embedding_layers=False)
        with_parts.append(out)
        w = load_adapter(out)  # A: the same linear LoRA, the vocabulary parts dropped
        w.vocab_lora, w.vocab_tokens = {}, {}
        w.spec = type(w.spec)(**{**w.spec.__dict__, "vocab_modules": (), "trainable_tokens": ()})
        plain.append(save_adapter(w, root / f"A-{names[i]}"))
        del base, peft_model
    return with_parts, plain


def run_batch(llm, prompts, new_tokens, loras) -> dict:
    from loramux.engine import SamplingParams

    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in new_tokens]
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, lora_request=loras)
    dt = time.perf_counter() - t0
    gen = sum(len(o.outputs[0].token_ids) for o in outs)
    total = gen + sum(len(p) for p in prompts)
    return {"seconds": dt, "generated_tokens_per_s": gen / dt, "total_tokens_per_s": total / dt,
            "outputs": [list(o.outputs[0].token_ids) for o in outs]}


def decode_step_ms(llm, prompt, lora, n: int) -> float:
    """One row: (time of ``n`` new tokens - time of 1) / (n - 1), in ms."""
    from loramux.engine import SamplingParams

    def t(k):
        p = SamplingParams(temperature=0, max_tokens=k, ignore_eos=True)
        t0 = time.perf_counter()
        llm.generate([{"prompt_token_ids": prompt}], p, lora_request=[lora])
        return time.perf_counter() - t0

    return (t(n) - t(1)) / (n - 1) * 1e3


def profile_b(llm, prompts, new_tokens, loras) -> dict:
    """One B run under torch.profiler, ``VocabStep.embed``/``head`` wrapped in record_function
    here (the engine is unchanged): their CPU time against the run's."""
    from torch.profiler import ProfilerActivity, profile, record_function

    from loramux.engine.lora import vocab as vocab_mod

    cls = vocab_mod.VocabStep
    orig = {"embed": cls.embed, "head": cls.head}

    def wrap(name, fn):
        def inner(self, *a, **k):
            with record_function(f"vocab.{name}"):
                return fn(self, *a, **k)
        return inner

    cls.embed, cls.head = wrap("embed", orig["embed"]), wrap("head", orig["head"])
    try:
        t0 = time.perf_counter()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            run_batch(llm, prompts, new_tokens, loras)
        wall = time.perf_counter() - t0
    finally:
        cls.embed, cls.head = orig["embed"], orig["head"]
    ev = {e.key: e for e in prof.key_averages()}
    out = {"wall_s_profiled": round(wall, 3)}
    for name in ("embed", "head"):
        e = ev.get(f"vocab.{name}")
        us = e.cpu_time_total if e is not None else 0.0
        out[f"vocab_{name}_ms"] = round(us / 1e3, 2)
        out[f"vocab_{name}_calls"] = e.count if e is not None else 0
    vocab_ms = out["vocab_embed_ms"] + out["vocab_head_ms"]
    out["vocab_share_of_wall"] = round(vocab_ms / 1e3 / wall, 4)
    out["top_ops"] = [{"op": e.key, "self_cpu_ms": round(e.self_cpu_time_total / 1e3, 1)}
                      for e in sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:12]]
    return out


def bench_dtype(model: Path, dtype: str, with_parts, plain, prompts, new_tokens, args) -> dict:
    from loramux.engine import LLM, LoRARequest

    n = len(with_parts)
    llm = LLM(str(model), dtype=dtype, device="cpu", enable_lora=True, max_loras=2 * n,
              max_lora_rank=16, max_model_len=512, max_num_seqs=len(prompts), enable_prefix_caching=False,
              max_num_batched_tokens=2048)
    kinds = {"A": [LoRARequest(f"A{i}", i + 1, str(p)) for i, p in enumerate(plain)],
             "B": [LoRARequest(f"B{i}", n + i + 1, str(p)) for i, p in enumerate(with_parts)]}
    rows = {k: [v[j % n] for j in range(len(prompts))] for k, v in kinds.items()}
    for k in kinds:  # warm-up: loads the adapters, first steps
        run_batch(llm, prompts, new_tokens, rows[k])
    runs: dict[str, list[dict]] = {"A": [], "B": []}
    outputs = {}
    for i in range(args.runs):
        for k in (("A", "B") if i % 2 == 0 else ("B", "A")):
            r = run_batch(llm, prompts, new_tokens, rows[k])
            outputs[k] = r.pop("outputs")
            runs[k].append({kk: round(v, 3) for kk, v in r.items()})
    med = {k: {m: round(statistics.median(r[m] for r in v), 2)
               for m in ("seconds", "generated_tokens_per_s", "total_tokens_per_s")}
           for k, v in runs.items()}
    ratio = med["B"]["generated_tokens_per_s"] / med["A"]["generated_tokens_per_s"]
    differ = sum(a != b for a, b in zip(outputs["A"], outputs["B"], strict=True))
    res = {"runs": runs, "median": med, "b_over_a": round(ratio, 3),
           "rows_whose_output_differs_a_vs_b": differ}
    print(f"[{dtype}] A {med['A']['generated_tokens_per_s']:.1f} gen tok/s, "
          f"B {med['B']['generated_tokens_per_s']:.1f} gen tok/s -> B/A {ratio:.3f} (goal >= {GOAL}); "
          f"{differ}/{len(prompts)} rows' outputs differ")
    if not args.skip_step:
        step: dict[str, dict] = {}
        prompt = prompts[0][:64]
        names = ["tokens0", "tokens1", "embed_lora", "head_lora"]
        for i, name in enumerate(names):
            a, b = [], []
            for _ in range(args.step_reps):
                a.append(decode_step_ms(llm, prompt, kinds["A"][i], args.step_tokens))
                b.append(decode_step_ms(llm, prompt, kinds["B"][i], args.step_tokens))
            ma, mb = statistics.median(a), statistics.median(b)
            step[name] = {"A_ms": round(ma, 2), "B_ms": round(mb, 2), "B_over_A_time": round(mb / ma, 3)}
        res["one_row_decode_step"] = step
        print(f"[{dtype}] one-row decode step ms (A vs B): "
              + ", ".join(f"{k} {v['A_ms']:.1f}/{v['B_ms']:.1f}" for k, v in step.items()))
    if ratio < GOAL or args.profile:
        res["profile_b"] = profile_b(llm, prompts, new_tokens, rows["B"])
        p = res["profile_b"]
        print(f"[{dtype}] profile of one B run: vocab embed {p['vocab_embed_ms']} ms, head "
              f"{p['vocab_head_ms']} ms of {p['wall_s_profiled']} s ({p['vocab_share_of_wall']:.1%})")
    del llm
    return res


def _plot(results: dict, name: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    dtypes = list(results)
    fig, ax = plt.subplots(figsize=(6.5, 3.5))
    w = 0.35
    for j, (k, label) in enumerate((("A", "A: 4 plain LoRA"), ("B", "B: + vocabulary parts"))):
        vals = [results[d]["median"][k]["generated_tokens_per_s"] for d in dtypes]
        bars = ax.bar([i + (j - 0.5) * w for i in range(len(dtypes))], vals, w, label=label)
        if k == "B":
            for d, bar in zip(dtypes, bars, strict=True):
                ax.annotate(f"B/A {results[d]['b_over_a']:.3f}", (bar.get_x() + w / 2, bar.get_height()),
                            ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(dtypes)), dtypes)
    ax.set_ylabel("generated tokens/s (median)")
    ax.set_title(f"SmolLM2-135M, 16 mixed prompts, 4 rank-16 adapters ({cpu_name()[:30]})", fontsize=8)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(RESULTS / f"{name}.png", dpi=120)


def main() -> None:
    ap = bench_parser(__doc__, dtype=None, quick="one run each, float32 only, no step timing",
                      out="vocab_adapters")
    ap.add_argument("--dtypes", default=None, help="comma list (default float32 and, with AVX512-BF16, bfloat16)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--step-tokens", type=int, default=16)
    ap.add_argument("--step-reps", type=int, default=2)
    ap.add_argument("--skip-step", action="store_true")
    ap.add_argument("--profile", action="store_true", help="profile one B run even when B/A >= 0.95")
    args = ap.parse_args()
    dtypes = (args.dtypes.split(",") if args.dtypes
              else ["float32"] + (["bfloat16"] if has_avx512_bf16() else []))
    if args.quick:
        args.runs, args.skip_step, dtypes = 1, True, ["float32"]
    t_start = time.perf_counter()
    model, tok = setup(args)
    prompts, new_tokens = make_prompts(tok, args.prompts)
    # trainable tokens: 8 ids each that the prompts hold (so the embedding path is hit), plus the
    # logits' columns of the tied head
    flat = [t for p in prompts for t in p[:4]]
    token_ids = [sorted(set(flat[0:8])), sorted(set(flat[8:16]))]
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        with_parts, plain = make_adapters(model, Path(tmp), token_ids)
        sizes = {p.name: sum(f.stat().st_size for f in p.iterdir()) for p in with_parts + plain}
        for dtype in dtypes:
            results[dtype] = bench_dtype(model, dtype, with_parts, plain, prompts, new_tokens, args)
    payload = {
        "config": {**vars(args), "dtypes": dtypes, "cpu": cpu_name(), "avx512_bf16": has_avx512_bf16(),
                   "prompt_lens": [len(p) for p in prompts], "new_tokens": new_tokens,
                   "adapters": {"A": "4x rank-16 LoRA on the 7 projections",
                                "B": "the same + trainable tokens (8 ids, tied) x2, embed_tokens LoRA, lm_head LoRA"},
                   "trainable_token_ids": token_ids, "adapter_bytes": sizes, "goal_b_over_a": GOAL},
        "results": results,
        "wall_s": round(time.perf_counter() - t_start, 1),
        "peak_rss_mb": round(peak_rss_mb(), 1),
    }
    path = write_json(args.out, payload)
    _plot(results, args.out)
    print(json.dumps({d: {"b_over_a": r["b_over_a"], "median": r["median"]} for d, r in results.items()}, indent=2))
    print(f"wrote {path} ({payload['wall_s']} s)")


if __name__ == "__main__":
    main()
