"""A pipeline of 3 activated LoRA (aLoRA) adapters over one long conversation, against the same
adapters served as plain LoRA: prompt tokens computed (not found in the prefix cache) and the
time to the three answers.

Each adapter answers in turn (as an agentic pipeline's checkers do), its prompt the shared
conversation (``--context`` tokens of ordinary text) followed by its own invocation. As plain
LoRA every adapter recomputes the whole conversation (its KV is the adapter's own); as aLoRA
the conversation before the invocation is the base model's KV, computed once by the first
adapter and found in the prefix cache by the other two. Both variants run on one engine,
alternating, each run over a conversation of its own (nothing is reused across runs), after a
warm-up. Writes bench/results/alora_pipeline.json.

    python -m bench.alora_pipeline [--quick] [--context 1000] [--runs 3] [--dtype bfloat16]
"""

from __future__ import annotations

import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from bench import lora_throughput
from bench.common import bench_parser, make_prompts, setup, write_json

ADAPTERS = 3


def make_adapters(model: Path, root: Path, invocations: list[list[int]]) -> tuple[list[Path], list[Path]]:
    """(aLoRA folders, the same weights as plain LoRA folders), one per invocation (random
    adapters on every projection, ranks 8/16: ``bench.lora_throughput.make_adapters``)."""
    plain = lora_throughput.make_adapters(model, root, len(invocations))
    alora = []
    for i, (p, inv) in enumerate(zip(plain, invocations, strict=True)):
        a = root / f"alora{i}"
        shutil.copytree(p, a)
        cfg = json.loads((a / "adapter_config.json").read_text())
        cfg["alora_invocation_tokens"] = inv
        (a / "adapter_config.json").write_text(json.dumps(cfg))
        alora.append(a)
    return alora, plain


def pipeline(llm, context: list[int], invocations, loras, max_tokens: int) -> dict:
    """The adapters answer one after the other; (prompt tokens computed, seconds)."""
    from loramux.engine import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    computed = 0
    t0 = time.perf_counter()
    for inv, lora in zip(invocations, loras, strict=True):
        prompt = context + inv
        (out,) = llm.generate([{"prompt_token_ids": prompt}], params, lora_request=[lora])
        computed += len(prompt) - out.num_cached_tokens
    return {"prefill_tokens": computed, "seconds": time.perf_counter() - t0}


def main() -> None:
    ap = bench_parser(__doc__, quick="one run, a 300-token conversation", out="alora_pipeline")
    ap.add_argument("--context", type=int, default=1000)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=8)
    args = ap.parse_args()
    if args.quick:
        args.context, args.runs = 300, 1
    from loramux.engine import LLM, LoRARequest

    model, tok = setup(args)
    invocations = [tok(f"<|im_start|>checker{i}\n").input_ids for i in range(ADAPTERS)]
    with tempfile.TemporaryDirectory() as tmp:
        alora, plain = make_adapters(model, Path(tmp), invocations)
        llm = LLM(str(model), dtype=args.dtype, device="cpu", enable_lora=True, max_loras=2 * ADAPTERS,
                  max_lora_rank=16, max_model_len=args.context + 256,
                  max_num_batched_tokens=args.context + 64)
        kinds = {
            "alora": [LoRARequest(f"alora{i}", i + 1, str(p)) for i, p in enumerate(alora)],
            "lora": [LoRARequest(f"plain{i}", ADAPTERS + i + 1, str(p)) for i, p in enumerate(plain)],
        }
        contexts = make_prompts(tok, 2 * args.runs + 2, args.context, seed=11)
        for loras in kinds.values():  # warm-up: loads the adapters, first steps
            pipeline(llm, contexts.pop(), invocations, loras, args.max_tokens)
        runs: dict[str, list[dict]] = {k: [] for k in kinds}
        for _ in range(args.runs):
            for kind, loras in kinds.items():
                runs[kind].append(pipeline(llm, contexts.pop(), invocations, loras, args.max_tokens))
    summary = {k: {"prefill_tokens": statistics.median(r["prefill_tokens"] for r in v),
                   "seconds": statistics.median(r["seconds"] for r in v)} for k, v in runs.items()}
    summary["prefill_ratio"] = summary["lora"]["prefill_tokens"] / summary["alora"]["prefill_tokens"]
    summary["time_ratio"] = summary["lora"]["seconds"] / summary["alora"]["seconds"]
    path = write_json(args.out, {"config": vars(args), "runs": runs, "summary": summary})
    print(json.dumps(summary, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
