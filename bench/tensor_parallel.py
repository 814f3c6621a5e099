"""Tensor parallelism on this machine: TP 1 (one process, all threads) vs TP N (N ranks, the
threads split between them), with 0 and 4 adapters, in one run.

Model: a random Llama (``--hidden`` 1024, 16 heads, 4 KV heads, intermediate 2816, 8 layers,
vocabulary 32000) written once; adapters: rank 16 on all 7 projections, round-robin over the
requests. Workload: ``--num-prompts`` prompts of ``--prompt-len`` tokens, ``--new-tokens``
greedy tokens each, all submitted at once. For each setting it reports output tokens/s, the
median decode step (every row decoding) and, under TP, the communication share of rank 0's
decode steps: the time in its all-reduces (the copy through shared memory and the wait for the
slower rank) over the step. Ratios are TP N ÷ TP 1 of the same adapters, and at TP N with 4
adapters ``fully_sharded_loras`` ÷ the default layout (throughput, decode step, rank 0's slot
bytes).

On a CPU the ranks share the memory bandwidth and the cores that TP 1 uses alone, so TP
there is a correctness and memory-per-process tool, not a speed-up: the numbers say by how
much it costs. Writes bench/results/tensor_parallel.json.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench.common import bench_parser, cpu_name, write_json
from bench.gpu_check_engine import write_random_adapters, write_random_llama

SHAPE = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16,
             num_key_value_heads=4, vocab_size=32000, tie_word_embeddings=False)


def _comm_share(engine, plan_steps: int) -> float:
    """Share of rank 0's decode-step time spent in all-reduces, over ``plan_steps`` steps."""
    from loramux.engine.distributed.group import reduce_seconds

    before, t0 = reduce_seconds(), time.perf_counter()
    for _ in range(plan_steps):
        if not engine.has_unfinished_requests():
            break
        engine.step()
    total = time.perf_counter() - t0
    return (reduce_seconds() - before) / total if total else 0.0


def run(model: Path, adapters: list[Path], tp: int, args, fully_sharded: bool = False) -> dict:
    from loramux.engine import SamplingParams
    from loramux.engine.config import EngineConfig
    from loramux.engine.engine import LLMEngine
    from loramux.engine.lora_request import LoRARequest

    torch.set_num_threads(args.threads)  # a TP run's rank 0 took its share of the cores
    engine = LLMEngine(EngineConfig.from_options(
        model=str(model), dtype=args.dtype, device="cpu", max_model_len=args.prompt_len + args.new_tokens + 16,
        enable_lora=bool(adapters), max_loras=max(1, len(adapters)), max_lora_rank=16,
        max_num_seqs=args.num_prompts, tensor_parallel_size=tp, fully_sharded_loras=fully_sharded))
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(2, SHAPE["vocab_size"], (args.num_prompts, args.prompt_len), generator=g).tolist()
    params = SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True)

    def submit(tag: str) -> None:
        for i, p in enumerate(prompts):
            lora = (LoRARequest(f"a{i % len(adapters)}", i % len(adapters) + 1, str(adapters[i % len(adapters)]))
                    if adapters else None)
            engine.add_request(f"{tag}{i}", {"prompt_token_ids": p}, params, lora_request=lora)

    submit("warm")  # adapters loaded, kernels warm
    while engine.has_unfinished_requests():
        engine.step()
    submit("r")
    steps, t0 = [], time.perf_counter()
    while engine.has_unfinished_requests():
        s = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - s)
    wall = time.perf_counter() - t0
    decode = steps[-max(1, args.new_tokens // 2):]  # the tail: every row decoding
    share = None
    if tp > 1:
        submit("p")
        while engine.has_unfinished_requests() and engine.num_steps < 10_000:
            engine.step()
            if len(engine.scheduler.running) == args.num_prompts and not engine.scheduler.waiting:
                break  # all prefilled: what follows are decode steps
        share = _comm_share(engine, 16)
        while engine.has_unfinished_requests():
            engine.step()
    runner = engine.runner
    if hasattr(runner, "shutdown"):
        runner.shutdown()
    buffers = getattr(engine.lora_manager, "buffers", None)
    return {"tp": tp, "adapters": len(adapters), "fully_sharded_loras": fully_sharded,
            "output_tokens_per_s": args.num_prompts * args.new_tokens / wall,
            "decode_step_ms_p50": 1e3 * statistics.median(decode), "comm_share": share,
            "rank0_slot_bytes": buffers.num_bytes() if buffers is not None else 0}


def main() -> None:
    ap = bench_parser(__doc__, dtype="float32", out="tensor_parallel")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=SHAPE["hidden_size"])
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=32)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    shape = dict(SHAPE, hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4 // 64 * 64)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "model"
        cfg = write_random_llama(model, shape, getattr(torch, args.dtype), torch.device("cpu"))
        adapters = write_random_adapters(Path(tmp) / "adapters", cfg, 4, 16, getattr(torch, args.dtype),
                                         torch.device("cpu"))
        for n_adapters, tp, fully in ((0, 1, False), (0, args.tp, False), (4, 1, False), (4, args.tp, False),
                                      (4, args.tp, True)):
            row = run(model, adapters[:n_adapters], tp, args, fully)
            rows.append(row)
            print(f"TP {tp}, {n_adapters} adapters{' fully sharded' if fully else ''}: "
                  f"{row['output_tokens_per_s']:.1f} tok/s, decode step "
                  f"{row['decode_step_ms_p50']:.1f} ms, rank 0 slots {row['rank0_slot_bytes'] / 2**20:.1f} MiB"
                  + (f", all-reduce share {row['comm_share']:.0%}" if row["comm_share"] is not None else ""),
                  flush=True)
    ratios = {}
    for n in (0, 4):
        one, many = (next(r for r in rows if r["tp"] == t and r["adapters"] == n and not r["fully_sharded_loras"])
                     for t in (1, args.tp))
        ratios[f"{n}_adapters"] = {
            "throughput_tp_over_tp1": many["output_tokens_per_s"] / one["output_tokens_per_s"],
            "decode_step_tp_over_tp1": many["decode_step_ms_p50"] / one["decode_step_ms_p50"]}
        print(f"{n} adapters: TP {args.tp} / TP 1 throughput {ratios[f'{n}_adapters']['throughput_tp_over_tp1']:.2f}x")
    default, fully = (next(r for r in rows if r["tp"] == args.tp and r["adapters"] == 4
                           and r["fully_sharded_loras"] == f) for f in (False, True))
    ratios["fully_sharded_over_default"] = {
        "throughput": fully["output_tokens_per_s"] / default["output_tokens_per_s"],
        "decode_step": fully["decode_step_ms_p50"] / default["decode_step_ms_p50"],
        "rank0_slot_bytes": fully["rank0_slot_bytes"] / default["rank0_slot_bytes"]}
    print("fully sharded / default at TP {}: throughput {throughput:.2f}x, decode step {decode_step:.2f}x, "
          "rank 0 slot bytes {rank0_slot_bytes:.2f}x".format(args.tp, **ratios["fully_sharded_over_default"]))
    path = write_json(args.out, {"cpu": cpu_name(), "dtype": args.dtype, "threads": args.threads,
                                 "shape": shape, "workload": {"num_prompts": args.num_prompts,
                                                              "prompt_len": args.prompt_len,
                                                              "new_tokens": args.new_tokens},
                                 "rows": rows, "ratios": ratios})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
