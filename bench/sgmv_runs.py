"""Prompt runs of one adapter in the SGMV kernel or in GEMMs on its rank: which costs a whole
engine step less (the evidence behind ``cpu_sgmv``'s run tables).

For each adapter rank and run length: a step of ``--decodes`` decode rows over 4 adapters plus one
prompt chunk of that length on an adapter of that rank is captured from the engine's scheduler,
then replayed alternately without its adapters (``base``), with the prompt run in GEMMs
(``gemm``: the run table's limit forced below the run) and in the kernel (``kernel``: forced
above it). Wall time (the calls split over threads), medians; each step's adapters' time is its
replay minus the base replay. Isolated calls flatter the GEMMs (their weights and y hot in the
caches); in a step the base's weights have evicted them.

    python -m bench.sgmv_runs --dtype bfloat16 --threads 2     # ~5 minutes, writes results/sgmv_runs_<dtype>.json
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench.common import bench_parser, make_engine, setup, write_json
from bench.lora_step import replay
from bench.lora_throughput import make_adapters

RANKS = (8, 16, 32)


def capture(eng, decode_loras, prompt_lora, decodes: int, chunk: int):
    """A step of ``decodes`` decode rows and a ``chunk``-token prompt chunk on ``prompt_lora``."""
    from loramux.engine.sampling_params import SamplingParams

    g = torch.Generator().manual_seed(chunk)
    params = SamplingParams(temperature=0, max_tokens=64, min_tokens=64, ignore_eos=True)
    for i in range(decodes):
        ids = torch.randint(1000, 30000, (100,), generator=g).tolist()
        eng.add_request(f"d{chunk}-{i}", {"prompt_token_ids": ids}, params,
                        lora_request=decode_loras[i % len(decode_loras)])
    found, decoding, real = [], [], eng.runner.execute

    def spy(plan):
        rows = plan.scheduled
        if len(rows) == decodes and not any(r.is_prefill for r in rows):
            decoding.append(True)
        if not found and any(r.is_prefill and r.num_new_tokens == chunk for r in rows) and len(rows) > decodes:
            found.append(plan)
        return real(plan)

    eng.runner.execute = spy
    for _ in range(50):  # the decodes' prompts, until a step of their decodes alone
        eng.step()
        if decoding:
            break
    ids = torch.randint(1000, 30000, (chunk,), generator=g).tolist()
    eng.add_request(f"p{chunk}", {"prompt_token_ids": ids}, SamplingParams(max_tokens=1), lora_request=prompt_lora)
    for _ in range(20):
        if found:
            break
        eng.step()
    eng.runner.execute = real
    while eng.has_unfinished_requests():
        eng.step()
    return found[0] if found else None


def compare(eng, plan, chunk: int, repeats: int) -> dict:
    """Median ms of the step's replays: base, the ``chunk``-token prompt run in GEMMs, in the
    kernel (the decode rows' runs in the kernel in both)."""
    from loramux.engine.lora.ops import cpu_sgmv

    def run(mode: str) -> float:
        if mode == "base":
            return replay(eng, plan, False, time.perf_counter)
        limit = chunk - 1 if mode == "gemm" else 1 << 20
        saved = cpu_sgmv.run_table
        cpu_sgmv.run_table = lambda w_dtype: ((max(RANKS), limit),)
        try:
            return replay(eng, plan, True, time.perf_counter)
        finally:
            cpu_sgmv.run_table = saved

    times = {m: [] for m in ("base", "gemm", "kernel")}
    for i in range(repeats + 2):
        for m in times:
            t = run(m)
            if i >= 2:
                times[m].append(t)
    base, gemm, kernel = (1e3 * statistics.median(times[m]) for m in times)
    return {"base_ms": base, "gemm_extra_ms": gemm - base, "kernel_extra_ms": kernel - base}


def main() -> None:
    ap = bench_parser(__doc__, dtype="bfloat16", threads=2)
    ap.add_argument("--decodes", type=int, default=8)
    ap.add_argument("--chunks", default="160,320,512,768,1000")
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    model, _ = setup(args)
    from loramux.engine.lora_request import LoRARequest
    from loramux.engine.model.kernels import loader

    chunks = [int(c) for c in args.chunks.split(",")]
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        paths = make_adapters(model, Path(tmp), 4, ranks=(8, 16, 32, 8))
        loras = [LoRARequest(f"a{i}", i + 1, str(p)) for i, p in enumerate(paths)]
        eng = make_engine(model=str(model), dtype=args.dtype, max_model_len=2048, max_num_seqs=64,
                          enable_lora=True, max_loras=4, max_lora_rank=max(RANKS), enable_step_budget=False,
                          max_num_batched_tokens=args.decodes + max(chunks))
        for chunk in chunks:
            for rank, lora in zip(RANKS, loras, strict=False):
                plan = capture(eng, loras, lora, args.decodes, chunk)
                if plan is None:
                    print(f"rank {rank} run {chunk}: no such step captured")
                    continue
                r = results[f"r{rank}_n{chunk}"] = {"rank": rank, "run": chunk,
                                                    **compare(eng, plan, chunk, args.repeats)}
                print(f"rank {rank:2d} run {chunk:4d}: base {r['base_ms']:7.1f} ms, adapters' extra with the run in "
                      f"GEMMs {r['gemm_extra_ms']:6.1f} ms, in the kernel {r['kernel_extra_ms']:6.1f} ms", flush=True)
    out = write_json(f"sgmv_runs_{args.dtype}", {"workload": vars(args), "isa": loader.status().isa,
                                                  "cpu": torch.cpu.get_capabilities().get("cpu_name"),
                                                  "results": results})
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
