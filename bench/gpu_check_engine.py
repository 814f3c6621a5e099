"""Engine parts of ``bench/gpu_check.py``: random Llama folders (no download), random
adapters, tokens/s with 0/1/8/32 distinct adapters in one batch, and greedy outputs of
the device path against the torch path.

A model folder is what the engine loads in production: ``config.json``, a word-level
tokenizer covering the vocabulary (``t0 .. t{V-1}``; no tokenizer file is needed on the
GPU machine) and sharded safetensors whose tensors are drawn on the device with a fixed
seed (a 7B model in bf16 is ~13 GB: drawing it on the CPU would take minutes).
"""

from __future__ import annotations

import gc
import json
import shutil
import tempfile
import time
from pathlib import Path

import torch

from bench.source_tree import load_test_support

COMMON = dict(max_position_embeddings=2048, rms_norm_eps=1e-5, bos_token_id=0, eos_token_id=1)
SHAPES = {  # Llama-3.2-1B and Llama-2-7B
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
               num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
               tie_word_embeddings=True),
    "7b": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
               num_attention_heads=32, num_key_value_heads=32, vocab_size=32000,
               tie_word_embeddings=False),
}  # fmt: skip
TOY_SHAPES = {  # the same structure at toy size (dry run)
    "1b": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, vocab_size=256, tie_word_embeddings=True),
    "7b": dict(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=4, vocab_size=256, tie_word_embeddings=False),
}  # fmt: skip
TINY = dict(TOY_SHAPES["1b"], vocab_size=512)  # tests/support/tiny_models.py's shape
MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def scratch_dir(need_bytes: int) -> Path:
    """A fresh folder on /dev/shm when it has room (no disk writes), else the temp dir."""
    for base in ("/dev/shm", tempfile.gettempdir()):
        if Path(base).is_dir() and shutil.disk_usage(base).free > 1.2 * need_bytes + (1 << 30):
            return Path(tempfile.mkdtemp(prefix="loramux-gpu-check-", dir=base))
    raise RuntimeError(f"no scratch space for {need_bytes / 2**30:.1f} GiB")


def write_tokenizer(path: Path, vocab_size: int) -> None:
    """A word-level tokenizer over ``t0 .. t{V-1}`` (bos ``t0``, eos ``t1``)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="t0", eos_token="t1", unk_token="t0"
    ).save_pretrained(path)


def param_shapes(cfg: dict) -> list[tuple[str, tuple[int, ...]]]:
    """Hugging Face tensor names and shapes of a Llama model."""
    h, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    d = h // cfg["num_attention_heads"]
    kv = cfg["num_key_value_heads"] * d
    out = [("model.embed_tokens.weight", (v, h))]
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        out += [
            (p + "input_layernorm.weight", (h,)), (p + "post_attention_layernorm.weight", (h,)),
            (p + "self_attn.q_proj.weight", (h, h)), (p + "self_attn.k_proj.weight", (kv, h)),
            (p + "self_attn.v_proj.weight", (kv, h)), (p + "self_attn.o_proj.weight", (h, h)),
            (p + "mlp.gate_proj.weight", (i, h)), (p + "mlp.up_proj.weight", (i, h)),
            (p + "mlp.down_proj.weight", (h, i)),
        ]  # fmt: skip
    out.append(("model.norm.weight", (h,)))
    if not cfg["tie_word_embeddings"]:
        out.append(("lm_head.weight", (v, h)))
    return out


def write_random_llama(
    path: Path, shape: dict, dtype: torch.dtype, device: torch.device, *, seed: int = 0,
    std: float = 0.02, shard_bytes: int = 2 << 30,
) -> dict:
    """Write a random Llama folder (config, tokenizer, sharded safetensors); returns its config."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    cfg = dict(COMMON, **shape)
    LlamaConfig(**cfg, architectures=["LlamaForCausalLM"]).save_pretrained(path)
    write_tokenizer(path, cfg["vocab_size"])
    g = torch.Generator(device).manual_seed(seed)
    weight_map, shard, size, n, total = {}, {}, 0, 0, 0

    def flush():
        nonlocal shard, size, n, total
        total += size
        name = f"model-{n:05d}.safetensors"
        save_file({k: t.cpu() for k, t in shard.items()}, str(path / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
        shard, size, n = {}, 0, n + 1

    for name, shp in param_shapes(cfg):
        if len(shp) == 1:  # norms
            t = torch.ones(shp, dtype=dtype, device=device)
        else:
            t = torch.empty(shp, dtype=dtype, device=device).normal_(0.0, std, generator=g)
        shard[name] = t
        size += t.numel() * t.element_size()
        if size >= shard_bytes:
            flush()
    if shard:
        flush()
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    return cfg


def adapter_bytes(cfg: dict, rank: int, dtype: torch.dtype) -> int:
    """Size of one adapter of rank ``rank`` on all 7 projections of model ``cfg``."""
    from loramux.adapters.arch import base_dims

    dims = base_dims(dict(cfg, model_type="llama"))
    per_layer = sum(i + o for i, o in dims.module_shapes().values()) * rank
    return per_layer * dims.num_layers * dtype.itemsize


def write_random_adapters(
    path: Path, cfg: dict, count: int, rank: int, dtype: torch.dtype, device: torch.device,
    *, seed: int = 0, std_b: float = 0.01,
) -> list[Path]:
    """``count`` distinct PEFT adapters of rank ``rank`` on all 7 projections."""
    from loramux.adapters.arch import base_dims
    from loramux.adapters.format import LoraWeights, save_adapter
    from loramux.adapters.spec import LoraSpec

    dims = base_dims(dict(cfg, model_type="llama"))
    spec = LoraSpec(r=rank, lora_alpha=2.0 * rank, target_modules=MODULES)
    shapes = dims.module_shapes()
    out = []
    for j in range(count):
        g = torch.Generator(device).manual_seed(seed + 1000 + j)
        layers = {}
        for layer in range(dims.num_layers):
            layers[layer] = {}
            for m in MODULES:
                fan_in, fan_out = shapes[m]
                a = torch.randn(rank, fan_in, generator=g, device=device) * fan_in**-0.5
                b = torch.randn(fan_out, rank, generator=g, device=device) * std_b
                layers[layer][m] = (a.to(dtype).cpu(), b.to(dtype).cpu())
        out.append(save_adapter(LoraWeights(spec, layers), path / f"a{j}"))
    return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def random_prompts(count: int, length: int | list[int], vocab: int, seed: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    lens = length if isinstance(length, list) else [length] * count
    return [{"prompt_token_ids": torch.randint(2, vocab, (n,), generator=g).tolist()} for n in lens]


def lora_requests(adapters: list[Path], n: int, rows: int, *, with_base: bool = False):
    """Row ``i`` runs adapter ``i % n`` of ``n`` distinct ones (None for ``n == 0``: the base
    model); ``with_base`` puts base-model rows between them (None, a0, a1, None, ...)."""
    from loramux.engine import LoRARequest

    if n == 0:
        return None
    choices = [None] if with_base else []
    choices += [LoRARequest(f"a{j}", j + 1, str(adapters[j])) for j in range(n)]
    return [choices[i % len(choices)] for i in range(rows)]


def engine_throughput(
    folder: Path, adapters: list[Path], counts: tuple[int, ...], *, device: torch.device,
    dtype: str, batch: int, prompt_len: int, new_tokens: int, reps: int, rank: int,
    vocab: int, lora_backend: str = "auto", tensor_parallel_size: int = 1,
) -> dict:
    """Decode tokens/s of one batch of ``batch`` rows with 0 (base) or ``n`` distinct
    adapters: ``t(N tokens) - t(1 token)`` over the same prompts, prefix caching off, best
    of ``reps`` with the adapter counts alternated. Ratio = base tok/s ÷ LoRA tok/s."""
    from loramux.engine import LLM, SamplingParams

    t0 = time.perf_counter()
    max_len = prompt_len + new_tokens + 16
    llm = LLM(
        str(folder), dtype=dtype, device=str(device), max_model_len=max_len, max_num_seqs=batch,
        enable_prefix_caching=False, enable_lora=True, max_loras=max(max(counts), 1),
        max_lora_rank=rank, max_cpu_loras=2 * max(max(counts), 1), lora_backend=lora_backend,
        num_gpu_blocks_override=2 * batch * -(-max_len // 16), tensor_parallel_size=tensor_parallel_size,
    )
    init_s = time.perf_counter() - t0
    prompts = random_prompts(batch, prompt_len, vocab, seed=1)

    def run(n: int, max_tokens: int) -> float:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        _sync(device)
        t = time.perf_counter()
        outs = llm.generate(prompts, params, lora_request=lora_requests(adapters, n, batch))
        _sync(device)
        secs = time.perf_counter() - t
        assert all(len(o.outputs[0].token_ids) == max_tokens for o in outs), "short output"
        return secs

    t0 = time.perf_counter()
    for n in counts:  # loads every adapter into its slot, compiles the kernels' variants
        run(n, 4)
    warmup_s = time.perf_counter() - t0
    first, total = {n: [] for n in counts}, {n: [] for n in counts}
    for rep in range(reps):
        for n in counts if rep % 2 == 0 else tuple(reversed(counts)):
            first[n].append(run(n, 1))
            total[n].append(run(n, new_tokens))
    rows = {}
    for n in counts:
        decode_s = max(min(total[n]) - min(first[n]), 1e-9)
        rows[str(n)] = {
            "adapters": n, "t_first_s": first[n], "t_total_s": total[n],
            "decode_tok_s": batch * (new_tokens - 1) / decode_s,
            "e2e_tok_s": batch * new_tokens / min(total[n]),
        }  # fmt: skip
    base = rows[str(counts[0])]
    for row in rows.values():
        row["slowdown_vs_base"] = base["decode_tok_s"] / row["decode_tok_s"]
        row["e2e_slowdown_vs_base"] = base["e2e_tok_s"] / row["e2e_tok_s"]
    llm = None  # free the model and its KV cache before the next shape
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"batch": batch, "prompt_len": prompt_len, "new_tokens": new_tokens, "rank": rank,
            "init_s": init_s, "warmup_s": warmup_s, "results": rows}  # fmt: skip


def greedy_check(
    folder: Path, adapters: list[Path], *, device: torch.device, lora_backend: str,
    prompts: list[dict], new_tokens: int, tensor_parallel_size: int = 1,
) -> dict:
    """Greedy outputs of the device path (``device`` + ``lora_backend``) vs the torch path
    (CPU, torch backends), fp32, base rows mixed with two adapters in one batch. Checked as
    ARCHITECTURE.md says: every device-path token is an argmax (within ``TIE_TOL``) of the
    Hugging Face (+ PEFT) reference given the same context, and where the two paths part,
    they part at a near tie."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from loramux.engine import LLM, SamplingParams

    gr = load_test_support("greedy_reference")
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    loras = lora_requests(adapters, len(adapters), len(prompts), with_base=True)
    outs = {}
    for name, dev, backend, tp in (("device", device, lora_backend, tensor_parallel_size),
                                   ("torch", torch.device("cpu"), "torch", 1)):
        llm = LLM(str(folder), dtype="float32", device=str(dev), enable_lora=True,
                  max_loras=len(adapters), max_lora_rank=8, lora_backend=backend,
                  max_model_len=256, num_gpu_blocks_override=512, tensor_parallel_size=tp)  # fmt: skip
        outs[name] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, lora_request=loras)]
        del llm
    base = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ref = PeftModel.from_pretrained(base, str(adapters[0]), adapter_name="a0").eval()
    for j, path in enumerate(adapters[1:], 1):
        ref.load_adapter(str(path), adapter_name=f"a{j}")
    rows = []
    for p, lr, dev_ids, torch_ids in zip(prompts, loras, outs["device"], outs["torch"], strict=True):
        ids = p["prompt_token_ids"]
        if lr is None:
            with ref.disable_adapter():
                logits = gr.teacher_forced_logits(ref, ids, dev_ids)
        else:
            ref.set_adapter(lr.lora_name)
            logits = gr.teacher_forced_logits(ref, ids, dev_ids)
        chosen = logits.gather(1, torch.tensor(dev_ids).unsqueeze(1)).squeeze(1)
        gap = float((logits.max(dim=-1).values - chosen).max())
        split = next((i for i, (a, b) in enumerate(zip(dev_ids, torch_ids, strict=False)) if a != b), None)
        margin = None
        if split is not None:
            top2 = logits[split].topk(2).values
            margin = float(top2[0] - top2[1])
        rows.append({
            "adapter": lr.lora_name if lr else None, "prompt_len": len(ids), "same": split is None,
            "first_difference": split, "margin_at_difference": margin, "max_gap": gap,
            "ok": gap <= gr.TIE_TOL and (margin is None or margin <= gr.TIE_TOL),
        })  # fmt: skip
    return {"tie_tol": gr.TIE_TOL, "new_tokens": new_tokens, "identical": sum(r["same"] for r in rows),
            "sequences": len(rows), "ok": all(r["ok"] for r in rows), "rows": rows}  # fmt: skip
