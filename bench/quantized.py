"""Weight-only int8 / int4 against float32 and bf16 on the CPU: one 2048 x 2048 projection and
one decode step of the default model (SmolLM2-135M), batch 1, 4 and 16 (the projection also 64
rows, a prefill chunk), in one run.

Projection: the engine's float ``Linear`` (oneDNN-packed) in float32 and bf16 against
``QuantLinear`` int8 per channel, int4 groups of 128 and 32 run by the compiled kernel
(``loramux::wq_linear``), int4 g128 on the torch path (dequantize a band, matmul; the
fallback), and int8 / int4 g128 layers of a bf16 model (bf16 activations: at 64 rows the op
hands dequantized bands to oneDNN) — best of timed calls, ratios to float32 of the same run. Decode step: the default
model loaded in float32, bf16 and as compressed-tensors int8 per channel / int4 g64 checkpoints
written here from its weights (576 input features: 128 does not divide them); the time per
decode step is (time of 1 + n steps - time of 1 step) / n for 1, 4 and 16 greedy sequences.
``--formats awq,gptq,fp8`` adds the same model as an AWQ GEMM and a GPTQ (v1) int4 g64
checkpoint (W4A16, packed as their loaders read them; both repacked at load for the same
kernel) and a compressed-tensors FP8 per-channel one (the same kernel, each byte widened), each
with float32 and bf16 activations.
Serving (``bench.quantized_serving``, ``--serving N`` requests, 0 for none): the float32, bf16,
W8A16 and W4A16 bases (the int checkpoints with bf16 activations) served with Poisson arrivals
(``--rate``), mixed prompt lengths and 4 adapters, against the same requests on the base alone.
Writes ``bench/results/quantized.json`` and ``.png``.

    python -m bench.quantized [--threads 2] [--quick] [--formats awq,gptq,fp8] [--serving 16]
"""

from __future__ import annotations

import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench.common import RESULTS, bench_parser, cpu_name
from loramux.engine.model.linear import Linear
from loramux.engine.model.quant.base import QuantLinear
from loramux.engine.model.quant.compressed_tensors import CompressedTensorsMethod

ROWS = (1, 4, 16)  # the batch 1-4, and a decode step of 16 sequences
PROJECTION_ROWS = (*ROWS, 64)  # and a prefill chunk

def quantize(w: torch.Tensor, bits: int, group: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric round-to-nearest of w [n, k]: signed values [n, k] int32, scale [n, G]."""
    n, k = w.shape
    g = group or k
    view = w.float().view(n, k // g, g)  # [n, G, g]
    scale = view.abs().amax(-1).clamp_min(1e-8) / ((1 << (bits - 1)) - 1)  # [n, G]
    q = torch.round(view / scale.unsqueeze(-1)).clamp(-(1 << (bits - 1)), (1 << (bits - 1)) - 1)
    return q.view(n, k).to(torch.int32), scale


def pack_int32(values: torch.Tensor, bits: int) -> torch.Tensor:
    """compressed-tensors' ``pack_to_int32`` along the rows: [n, k] signed → int32 [n, words]."""
    n, k = values.shape
    per = 32 // bits
    u = (values.long() + (1 << (bits - 1))) & ((1 << bits) - 1)
    u = torch.nn.functional.pad(u, (0, -k % per)).view(n, -1, per)  # [n, words, per]
    words = (u << torch.arange(0, 32, bits)).sum(-1)  # [n, words] int64 < 2^32
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def method(bits: int, group: int | None) -> CompressedTensorsMethod:
    weights = {"type": "int", "num_bits": bits, "strategy": "group" if group else "channel",
               "group_size": group, "symmetric": True}
    return CompressedTensorsMethod({"format": "pack-quantized", "config_groups": {
        "group_0": {"targets": ["Linear"], "weights": weights}}}, "bench")


def quant_linear(w: torch.Tensor, bits: int, group: int | None, kernel: bool,
                 dtype: torch.dtype = torch.float32) -> QuantLinear:
    """w [n, k] as a compressed-tensors layer of a ``dtype`` model (repacked for the kernel
    when ``kernel``)."""
    q, scale = quantize(w, bits, group)
    n, k = w.shape
    tensors = {"p.weight_packed": pack_int32(q, bits), "p.weight_scale": scale,
               "p.weight_shape": torch.tensor([n, k])}
    m = method(bits, group)
    if not kernel:
        m._runs_kernel = lambda *a: False
    return m.create_linear(["p"], lambda name, *d: tensors.pop(name), None, shapes=[(n, k)],
                           dtype=dtype)


def timed(fn, x: torch.Tensor, seconds: float) -> tuple[float, float]:
    """(median, best) seconds of one call after warm-up, over calls for about ``seconds``
    (the best is the figure a machine shared with other jobs still gives)."""
    for _ in range(5):
        fn(x)
    times = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end or len(times) < 10:
        t0 = time.perf_counter()
        fn(x)
        times.append(time.perf_counter() - t0)
    return statistics.median(times), min(times)


def projection(size: int, seconds: float) -> dict:
    w = torch.randn(size, size) / size ** 0.5
    layers = {
        "float32": Linear(w.clone()),
        "bf16": Linear(w.to(torch.bfloat16)),
        "int8": quant_linear(w, 8, None, True),
        "int4_g128": quant_linear(w, 4, 128, True),
        "int4_g32": quant_linear(w, 4, 32, True),
        "int4_g128_torch": quant_linear(w, 4, 128, False),
        "int8_bf16": quant_linear(w, 8, None, True, torch.bfloat16),  # bf16 x (W8A16 proper)
        "int4_g128_bf16": quant_linear(w, 4, 128, True, torch.bfloat16),
    }
    out = {}
    for m in PROJECTION_ROWS:
        x = torch.randn(m, size)
        row = {}
        for name, layer in layers.items():
            xi = x.to(torch.bfloat16) if name.startswith("bf16") or name.endswith("bf16") else x
            median, best = timed(layer, xi, seconds)
            row[name] = {"ms": best * 1e3, "median_ms": median * 1e3, "bytes": layer.nbytes}
        base = row["float32"]["ms"]
        for r in row.values():
            r["speedup_vs_float32"] = base / r["ms"]  # best against best
        out[f"M={m}"] = row
        print(f"projection {size}x{size} M={m} (best of calls): " + ", ".join(
            f"{n} {r['ms']:.3f} ms ({r['speedup_vs_float32']:.2f}x)" for n, r in row.items()))
    return out


def write_checkpoint(src: Path, dst: Path, bits: int, group: int | None) -> Path:
    """The model folder ``src`` with every decoder projection as compressed-tensors int weights."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(src / "model.safetensors")
    for name in [n for n in tensors if ".layers." in n and n.endswith("_proj.weight")]:
        w = tensors.pop(name)
        q, scale = quantize(w, bits, group)
        p = name.removesuffix("weight")
        tensors[p + "weight_packed"] = pack_int32(q, bits)
        tensors[p + "weight_scale"] = scale.to(w.dtype)
        tensors[p + "weight_shape"] = torch.tensor(list(w.shape))
    save_file(tensors, dst / "model.safetensors")
    config = json.loads((src / "config.json").read_text())
    weights = {"type": "int", "num_bits": bits, "strategy": "group" if group else "channel",
               "group_size": group, "symmetric": True}
    config["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head"],
        "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights}}}
    (dst / "config.json").write_text(json.dumps(config))
    return dst


AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ's: slot i of a word holds column 8c + AWQ_ORDER[i]


def pack_columns(u: torch.Tensor, order: list[int]) -> torch.Tensor:
    """Unsigned 4-bit u [r, c] → int32 [r, c / 8], slot i of word j holding column 8j + order[i]."""
    v = u.long().view(u.shape[0], -1, 8)[:, :, order]  # [r, words, 8 slots]
    words = (v << torch.arange(0, 32, 4)).sum(-1)
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def write_other_format(src: Path, dst: Path, fmt: str) -> Path:
    """The model folder ``src`` with every decoder projection as ``fmt``: ``awq`` (GEMM) or
    ``gptq`` (v1) int4 g64 symmetric (zero points 8), or compressed-tensors ``fp8`` per channel."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(src / "model.safetensors")
    for name in [n for n in tensors if ".layers." in n and n.endswith("_proj.weight")]:
        w, p = tensors.pop(name).float(), name.removesuffix("weight")
        if fmt == "fp8":
            scale = w.abs().amax(1, keepdim=True).clamp_min(1e-8) / 448  # [out, 1]
            tensors[p + "weight"] = (w / scale).to(torch.float8_e4m3fn)
            tensors[p + "weight_scale"] = scale
            continue
        q, scale = quantize(w, 4, 64)
        u, zeros = q + 8, torch.full((scale.shape[1], scale.shape[0]), 8)  # [out, in], [G, out]
        if fmt == "awq":
            tensors[p + "qweight"], tensors[p + "qzeros"] = pack_columns(u.T, AWQ_ORDER), pack_columns(zeros, AWQ_ORDER)
        else:
            tensors[p + "qweight"] = pack_columns(u, list(range(8))).T.contiguous()  # [in / 8, out]
            tensors[p + "qzeros"] = pack_columns(zeros - 1, list(range(8)))  # v1: zero - 1
            tensors[p + "g_idx"] = (torch.arange(w.shape[1]) // 64).to(torch.int32)
        tensors[p + "scales"] = scale.T.half().contiguous()  # [G, out] fp16, as they store it
    save_file(tensors, dst / "model.safetensors")
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {
        "awq": {"quant_method": "awq", "bits": 4, "group_size": 64, "zero_point": True, "version": "gemm"},
        "gptq": {"quant_method": "gptq", "bits": 4, "group_size": 64, "desc_act": False, "sym": True,
                 "checkpoint_format": "gptq"},
        "fp8": {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
                "quantization_status": "compressed", "config_groups": {"group_0": {
                    "targets": ["Linear"], "weights": {"type": "float", "num_bits": 8, "strategy": "channel"},
                    "input_activations": {"type": "float", "num_bits": 8, "strategy": "token",
                                          "dynamic": True}}}},
    }[fmt]
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def decode_step(folder: Path, dtype: str, steps: int) -> dict:
    from loramux.engine import LLM, SamplingParams

    llm = LLM(str(folder), dtype=dtype, device="cpu")
    prompts = [{"prompt_token_ids": list(range(100 + 7 * i, 132 + 7 * i))} for i in range(max(ROWS))]
    out = {}
    for m in ROWS:
        def run(n: int, m: int = m) -> float:
            sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
            t0 = time.perf_counter()
            llm.generate(prompts[:m], sp)
            return time.perf_counter() - t0
        run(steps)  # warm-up
        one = min(run(1) for _ in range(3))
        full = min(run(1 + steps) for _ in range(3))
        out[f"M={m}"] = {"ms_per_step": (full - one) / steps * 1e3}
    out["weight_bytes"] = llm.llm_engine.model.weight_bytes()
    return out



def serving(folders: dict, tmp: Path, args) -> dict:
    """The serving run (``bench.quantized_serving``) on the float32, bf16, W8A16 and W4A16 bases
    with the same adapters and requests."""
    from bench.lora_throughput import make_adapters
    from bench.quantized_serving import serve, serving_args

    adapters = make_adapters(folders["float32"][0], tmp / "adapters", 4)
    workload = serving_args(args.serving, args.rate)
    out = {"args": vars(workload)}
    for name in ("float32", "bf16", "int8_bf16", "int4_g64_bf16"):
        folder, dtype = folders[name]
        out[name] = r = serve(folder, dtype, adapters, workload)
        print(f"serving {name}: " + ", ".join(
            f"{k} {r[k]['output_tok_s']:.1f} tok/s TTFT p50 {r[k]['ttft_s']['p50']:.2f} s "
            f"TPOT p50 {r[k]['tpot_ms_p50']:.0f} ms" for k in ("lora", "base"))
            + f"; LoRA/base {r['lora_over_base_tok_s']:.2f}", flush=True)
    for name in ("int8_bf16", "int4_g64_bf16"):
        out[name]["lora_tok_s_over_bf16_lora"] = (out[name]["lora"]["output_tok_s"]
                                                  / out["bf16"]["lora"]["output_tok_s"])
    return out


def main(argv: list[str] | None = None) -> int:
    ap = bench_parser(__doc__, dtype=None, quick="shorter timings", out="quantized")
    ap.add_argument("--size", type=int, default=2048)
    ap.add_argument("--no-model", action="store_true", help="the projection only")
    ap.add_argument("--formats", default="", help="also decode awq,gptq,fp8 checkpoints of the model")
    ap.add_argument("--serving", type=int, default=16, metavar="N",
                    help="requests of the serving run per base (0: none)")
    ap.add_argument("--rate", type=float, default=2.0, help="the serving run's Poisson arrivals per second")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from loramux.engine.model.kernels import loader

    result = {"cpu": cpu_name(), "threads": args.threads,
              "kernels": loader.status().isa, "projection": projection(args.size, 0.5 if args.quick else 2.0)}
    if not args.no_model:
        from loramux.engine.default_model import default_model_path

        src, steps = default_model_path(), 16 if args.quick else 32
        models = {}
        with tempfile.TemporaryDirectory() as tmp:
            folders = {"float32": (src, "float32"), "bf16": (src, "bfloat16"),
                       "int8": (write_checkpoint(src, Path(tmp) / "int8", 8, None), "float32"),
                       "int4_g64": (write_checkpoint(src, Path(tmp) / "int4", 4, 64), "float32")}
            # W8A16 / W4A16 proper: the same checkpoints with bf16 activations (and lm_head)
            folders["int8_bf16"] = (folders["int8"][0], "bfloat16")
            folders["int4_g64_bf16"] = (folders["int4_g64"][0], "bfloat16")
            for fmt in filter(None, args.formats.split(",")):
                name = {"awq": "awq_int4_g64", "gptq": "gptq_int4_g64", "fp8": "fp8_channel"}[fmt]
                folders[name] = (write_other_format(src, Path(tmp) / fmt, fmt), "float32")
                folders[name + "_bf16"] = (folders[name][0], "bfloat16")
            for name, (folder, dtype) in folders.items():
                models[name] = decode_step(folder, dtype, steps)
            if args.serving:
                result["serving"] = serving(folders, Path(tmp), args)
        for m in ROWS:
            base = models["float32"][f"M={m}"]["ms_per_step"]
            bf16 = models["bf16"][f"M={m}"]["ms_per_step"]
            for r in models.values():
                r[f"M={m}"]["speedup_vs_float32"] = base / r[f"M={m}"]["ms_per_step"]
                r[f"M={m}"]["speedup_vs_bf16"] = bf16 / r[f"M={m}"]["ms_per_step"]
            print(f"decode step M={m} (x float32, x bf16): " + ", ".join(
                f"{n} {r[f'M={m}']['ms_per_step']:.2f} ms ({r[f'M={m}']['speedup_vs_float32']:.2f}x, "
                f"{r[f'M={m}']['speedup_vs_bf16']:.2f}x)"
                for n, r in models.items()))
        result["decode_step"] = models
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{args.out}.json").write_text(json.dumps(result, indent=2) + "\n")
    if "decode_step" in result:
        plot(result, RESULTS / f"{args.out}.png")
    print(f"wrote bench/results/{args.out}.json (and .png)")
    return 0


def plot(result: dict, path: Path) -> None:
    """Decode step ms per base at batch 1, 4 and 16 (speedup over bf16 above each bar) and, when the
    serving run ran, its output tok/s with adapters and on the base alone."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models, serving = result["decode_step"], result.get("serving") or {}
    serving = {n: r for n, r in serving.items() if isinstance(r, dict) and "lora" in r}
    fig, axes = plt.subplots(1, 2 if serving else 1, figsize=(14 if serving else 9, 4), squeeze=False)
    names = list(models)
    for j, m in enumerate(ROWS):
        xs = [i + j * 0.27 for i in range(len(names))]
        ms = [models[n][f"M={m}"]["ms_per_step"] for n in names]
        axes[0][0].bar(xs, ms, 0.27, label=f"batch {m}")
        for x, n, v in zip(xs, names, ms, strict=True):
            axes[0][0].text(x, v, f"{models[n][f'M={m}']['speedup_vs_bf16']:.2f}x", ha="center",
                            va="bottom", fontsize=7)
    axes[0][0].set_xticks([i + 0.27 for i in range(len(names))], names, rotation=20, fontsize=8)
    axes[0][0].set_title(f"decode step (ms; x bf16 above), {result.get('cpu', '')}", fontsize=9)
    axes[0][0].legend()
    if serving:
        ax, sn = axes[0][1], list(serving)
        for j, key in enumerate(("lora", "base")):
            ax.bar([i + j * 0.4 for i in range(len(sn))], [serving[n][key]["output_tok_s"] for n in sn],
                   0.4, label="4 adapters" if key == "lora" else "base alone")
        ax.set_xticks([i + 0.2 for i in range(len(sn))], sn, rotation=20, fontsize=8)
        ax.set_title("serving run: output tok/s", fontsize=9)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=90)


if __name__ == "__main__":
    raise SystemExit(main())
