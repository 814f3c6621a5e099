"""The MoE device check (CUDA): the Triton grouped GEMM of the experts timed against the
per-expert loop, and greedy outputs of tiny Qwen3-MoE and Mixtral bases with attention-only
and expert LoRA adapters on the device path against the CPU torch path and transformers + PEFT
(``gpu_check_engine.greedy_check``: every token an argmax within the tie tolerance).

GEMM shapes: Qwen3-30B-A3B's experts (128 experts, hidden 2048, expert size 768, top-8) in
bf16 at 1 / 16 / 256 / 2048 tokens. ``--dry-run`` runs toy sizes on the CPU (the kernel under
``TRITON_INTERPRET=1``, the engine on the torch path) to check the script itself.
Writes bench/results/gpu_check_moe.json.

    python3 -m bench.gpu_check_moe            # on the GPU machine, ~2 minutes
    python3 -m bench.gpu_check_moe --dry-run
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent


def gemm_timing(device, dry: bool) -> list[dict]:
    import torch
    import torch.nn.functional as F

    from loramux.engine.model.triton_moe import grouped_matmul

    e, h, i, k = (8, 32, 24, 2) if dry else (128, 2048, 768, 8)
    dtype = torch.float32 if dry else torch.bfloat16
    g = torch.Generator(device=device).manual_seed(0)
    w = torch.randn(e, 2 * i, h, generator=g, device=device, dtype=dtype) * 0.02
    rows = []
    for tokens in ((1, 5) if dry else (1, 16, 256, 2048)):
        experts = torch.randint(0, e, (tokens * k,), generator=g, device=device)
        counts = torch.bincount(experts, minlength=e).tolist()
        x = torch.randn(tokens * k, h, generator=g, device=device, dtype=dtype)

        def loop(x=x, counts=counts):
            out, start = torch.empty(x.shape[0], w.shape[1], device=device, dtype=dtype), 0
            for j, c in enumerate(counts):
                if c:
                    out[start:start + c] = F.linear(x[start:start + c], w[j])
                    start += c
            return out

        def timed(fn, n=3 if dry else 20):
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(n):
                out = fn()
            if device.type == "cuda":
                torch.cuda.synchronize()
            return (time.perf_counter() - t0) / n * 1e3, out

        t_loop, want = timed(loop)
        t_triton, got = timed(lambda x=x, counts=counts: grouped_matmul(x, w, counts))
        err = float((got.float() - want.float()).abs().max())
        rows.append({"tokens": tokens, "rows": tokens * k, "loop_ms": t_loop, "triton_ms": t_triton,
                     "speedup": t_loop / t_triton, "max_abs_diff": err, "ok": err <= 2e-2})
        print(f"grouped GEMM {tokens:5d} tokens: loop {t_loop:8.3f} ms  triton {t_triton:8.3f} ms  "
              f"diff {err:.2e}", flush=True)
    return rows


def make_base(family: str, root: Path) -> Path:
    import torch
    import transformers

    from bench.gpu_check_engine import write_tokenizer

    vocab = 512
    common = dict(vocab_size=vocab, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=512, bos_token_id=0, eos_token_id=1,
                  num_experts_per_tok=2)
    if family == "qwen3_moe":
        cfg = transformers.Qwen3MoeConfig(**common, intermediate_size=128, moe_intermediate_size=32,
                                          num_experts=8, norm_topk_prob=True, head_dim=16)
        model = transformers.Qwen3MoeForCausalLM(cfg)
    else:
        cfg = transformers.MixtralConfig(**common, intermediate_size=48, num_local_experts=4)
        model = transformers.MixtralForCausalLM(cfg)
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0.0, 0.5 if "mlp.gate." in name else 0.08)
    path = root / family
    model.save_pretrained(path, safe_serialization=True)
    write_tokenizer(path, vocab)
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--out", default="gpu_check_moe")
    args = ap.parse_args()
    import torch

    if args.dry_run and not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from bench.source_tree import load_test_support, use_source_tree

    use_source_tree()
    from bench.gpu_check_engine import greedy_check, random_prompts

    device = torch.device("cpu" if args.dry_run else "cuda")
    report = {"device": str(device), "gemm": gemm_timing(device, args.dry_run), "greedy": {}}
    lf = load_test_support("lora_fixtures")
    experts = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    with tempfile.TemporaryDirectory() as tmp:
        for family in ("qwen3_moe", "mixtral"):
            base = make_base(family, Path(tmp))
            adapters = [
                lf.make_peft_adapter(base, Path(tmp) / f"{family}-attn", r=8, target_modules=["q_proj", "v_proj"],
                                     std=0.1, seed=1),
                lf.make_peft_adapter(base, Path(tmp) / f"{family}-experts", r=4, target_modules=["o_proj"],
                                     target_parameters=experts, std=0.3, seed=2),
            ]
            prompts = random_prompts(6, [5, 40, 9, 70, 3, 20], 512, seed=3)
            report["greedy"][family] = r = greedy_check(
                base, adapters, device=device, lora_backend="torch" if args.dry_run else "triton",
                prompts=prompts, new_tokens=8)
            print(f"greedy {family}: ok={r['ok']} identical {r['identical']}/{r['sequences']}", flush=True)
    report["ok"] = all(r["ok"] for r in report["gemm"]) and all(r["ok"] for r in report["greedy"].values())
    out = BENCH / "results" / f"{args.out}{'_dry' if args.dry_run else ''}.json"
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"ok={report['ok']}; wrote {out}")


if __name__ == "__main__":
    main()
