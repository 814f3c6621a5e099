"""AWQ and GPTQ checkpoints written from the formats' published layouts (AutoAWQ's
``WQLinear_GEMM.from_linear`` packing, AutoGPTQ / GPTQModel's v1 ``QuantLinear.pack``), and
their reference dequantization written independently of the engine (a loop per packed
slot, as the formats' own dequantizers read them): the float folder transformers and PEFT
load as the reference.

Neither library installs here (their packages pull CUDA builds or another torch), so the
packing is this file's, one rule per published layout:

- AWQ GEMM: ``qweight`` int32 [in, out/8], word ``c`` of input row ``k`` holds column
  ``8c + ORDER[i]`` in bits ``4i``, ``ORDER = [0, 2, 4, 6, 1, 3, 5, 7]``; ``qzeros`` int32
  [in/g, out/8] the same way; ``scales`` fp16 [in/g, out]; ``W = (q - z) * s``.
- GPTQ (v1, ``checkpoint_format: gptq``): ``qweight`` int32 [in·bits/32, out], word ``i`` of
  column ``n`` holds input rows ``i·p + j`` in bits ``bits·j`` (p = 32/bits); ``qzeros`` int32
  [G, out·bits/32] packed along the output the same way, storing ``zero - 1``; ``scales`` fp16
  [G, out]; ``g_idx`` int32 [in], each input row's group; ``W[n, k] = (q - z[g_idx[k]]) *
  s[g_idx[k]]`` with ``z = (stored + 1) & (2^bits - 1)``. ``gptq_v2`` stores ``zero`` itself.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "qkv_proj",
        "gate_up_proj")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def _targets(tensors: dict, skip: tuple[str, ...]) -> list[str]:
    return [k[:-len(".weight")] for k, v in tensors.items()
            if k.endswith(".weight") and v.dim() == 2 and k.split(".")[-2] in PROJ
            and not any(s in k for s in skip)]


def _minmax(w: torch.Tensor, bits: int, sym: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and unsigned zero of each row of ``w`` [n, c] (one group): [n] each."""
    maxq = (1 << bits) - 1
    if sym:
        scale = (w.abs().amax(1) * 2 / maxq).clamp_min(1e-5)
        return scale, torch.full_like(scale, (maxq + 1) // 2).int()
    lo, hi = w.amin(1).clamp(max=0), w.amax(1).clamp(min=0)
    scale = ((hi - lo) / maxq).clamp_min(1e-5)
    return scale, torch.round(-lo / scale).clamp(0, maxq).int()


def _quantize(w: torch.Tensor, g_idx: torch.Tensor, groups: int, bits: int, sym: bool):
    """Per-group min-max quantization of w [out, in] by g_idx: q [out, in] unsigned int32,
    scales fp16 [G, out], zeros int32 [G, out]."""
    out, k = w.shape
    scales, zeros = torch.zeros(groups, out, dtype=torch.float16), torch.zeros(groups, out, dtype=torch.int32)
    q = torch.zeros(out, k, dtype=torch.int32)
    for j in range(groups):
        cols = (g_idx == j).nonzero().flatten()
        s, z = _minmax(w[:, cols], bits, sym)
        s = s.half()
        scales[j], zeros[j] = s, z
        q[:, cols] = (torch.round(w[:, cols] / s.float()[:, None]) + z[:, None]).clamp(0, (1 << bits) - 1).int()
    return q, scales, zeros


def _pack_columns(v: torch.Tensor, bits: int, order) -> torch.Tensor:
    """Pack v [r, c] unsigned along its columns: word ``c // p`` slot ``i`` holds column
    ``p·(c // p) + order[i]``."""
    p = 32 // bits
    out = torch.zeros(v.shape[0], v.shape[1] // p, dtype=torch.int64)
    for col in range(v.shape[1] // p):
        for i in range(p):
            out[:, col] |= (v[:, col * p + order[i]].long() & ((1 << bits) - 1)) << (bits * i)
    return (out - ((out >> 31) << 32)).int()  # two's complement int32


def _unpack_columns(words: torch.Tensor, bits: int, order) -> torch.Tensor:
    p = 32 // bits
    w = words.long() & 0xFFFFFFFF
    out = torch.zeros(words.shape[0], words.shape[1] * p, dtype=torch.int64)
    for col in range(words.shape[1]):
        for i in range(p):
            out[:, col * p + order[i]] = (w[:, col] >> (bits * i)) & ((1 << bits) - 1)
    return out


def _save(src: Path, out: Path, tensors: dict, qc: dict) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    if qc:
        cfg["quantization_config"] = qc
    (out / "config.json").write_text(json.dumps(cfg))
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.name not in ("config.json", "model.safetensors.index.json"):
            shutil.copy(f, out / f.name)
    return out


def write_awq(src: Path, out: Path, *, group_size: int = 32, zero_point: bool = True,
              skip: tuple[str, ...] = ()) -> Path:
    """The float folder ``src`` quantized to an AutoAWQ GEMM 4-bit checkpoint at ``out``."""
    tensors = load_file(src / "model.safetensors")
    for m in _targets(tensors, skip):
        w = tensors.pop(m + ".weight").float()
        k = w.shape[1]
        g = group_size if group_size > 0 else k
        q, s, z = _quantize(w, torch.arange(k) // g, k // g, 4, not zero_point)
        tensors[m + ".qweight"] = _pack_columns(q.T.contiguous(), 4, AWQ_ORDER)  # [in, out/8]
        if zero_point:  # without: the symmetric zero point 8 (uint4b8)
            tensors[m + ".qzeros"] = _pack_columns(z, 4, AWQ_ORDER)  # [G, out/8]
        tensors[m + ".scales"] = s  # [G, out]
    qc = {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": zero_point,
          "version": "gemm", "modules_to_not_convert": list(skip) or None}
    return _save(src, out, tensors, qc)


def write_gptq(src: Path, out: Path, *, bits: int = 4, group_size: int = 32, desc_act: bool = False,
               sym: bool = True, fmt: str = "gptq", shared_perm: bool = False, seed: int = 0,
               lm_head: bool = False) -> Path:
    """The float folder ``src`` quantized to a GPTQ checkpoint at ``out`` (``fmt``: ``gptq``
    v1 zeros - 1, or ``gptq_v2``). ``desc_act``: each module's groups follow a random
    permutation of its input columns (one per input width when ``shared_perm``); ``lm_head``:
    the (untied) ``lm_head`` quantized too, as GPTQModel's ``lm_head=True``."""
    tensors = load_file(src / "model.safetensors")
    gen = torch.Generator().manual_seed(seed)
    perms: dict[int, torch.Tensor] = {}
    for m in _targets(tensors, ()) + (["lm_head"] if lm_head else []):
        w = tensors.pop(m + ".weight").float()
        k = w.shape[1]
        g = group_size if group_size > 0 else k
        order = torch.arange(k)
        if desc_act:
            order = perms.setdefault(k, torch.randperm(k, generator=gen)) if shared_perm else \
                torch.randperm(k, generator=gen)
        g_idx = torch.empty(k, dtype=torch.int32)
        g_idx[order] = (torch.arange(k) // g).int()  # the i-th column in act order: group i // g
        q, s, z = _quantize(w, g_idx, k // g, bits, sym)
        tensors[m + ".qweight"] = _pack_columns(q, bits, range(32 // bits)).T.contiguous()  # rows of W^T
        tensors[m + ".qzeros"] = _pack_columns(z - 1 if fmt == "gptq" else z, bits, range(32 // bits))
        tensors[m + ".scales"] = s
        tensors[m + ".g_idx"] = g_idx
    qc = {"quant_method": "gptq", "bits": bits, "group_size": group_size, "desc_act": desc_act,
          "sym": sym, "lm_head": lm_head, "checkpoint_format": fmt, "pack_dtype": "int32",
          "true_sequential": True, "damp_percent": 0.01, "static_groups": False,
          "meta": {"quantizer": ["loramux-tests"]}}
    return _save(src, out, tensors, qc)


def reference_weights(folder: Path) -> dict[str, torch.Tensor]:
    """Every quantized module's weight [out, in] float32, dequantized from ``folder`` by the
    format's rule (module name → weight)."""
    qc = json.loads((folder / "config.json").read_text())["quantization_config"]
    t = load_file(folder / "model.safetensors")
    bits = qc["bits"]
    mask = (1 << bits) - 1
    out = {}
    for m in [k[:-len(".qweight")] for k in t if k.endswith(".qweight")]:
        s = t[m + ".scales"].float()
        if qc["quant_method"] == "awq":
            q = _unpack_columns(t[m + ".qweight"], 4, AWQ_ORDER)  # [in, out]
            z = (_unpack_columns(t[m + ".qzeros"], 4, AWQ_ORDER) if m + ".qzeros" in t
                 else torch.full(s.shape, 8, dtype=torch.int64))  # [G, out]
            g_idx = torch.arange(q.shape[0]) // (q.shape[0] // s.shape[0])
        else:
            q = _unpack_columns(t[m + ".qweight"].T, bits, range(32 // bits)).T  # [in, out]
            z = _unpack_columns(t[m + ".qzeros"], bits, range(32 // bits))
            if qc.get("checkpoint_format", "gptq") == "gptq":
                z = (z + 1) & mask
            g_idx = t[m + ".g_idx"].long()
        out[m] = ((q - z[g_idx]).float() * s[g_idx]).T.contiguous()  # [out, in]
    return out


def write_dequantized(folder: Path, out: Path) -> Path:
    """A float folder of ``folder``'s weights dequantized by :func:`reference_weights`: what
    transformers and PEFT load as the reference."""
    if (out / "model.safetensors").exists():
        return out
    t = {k: v.float() for k, v in load_file(folder / "model.safetensors").items()
         if k.rsplit(".", 1)[-1] not in ("qweight", "qzeros", "scales", "g_idx")}
    t.update({m + ".weight": w for m, w in reference_weights(folder).items()})
    out.mkdir(parents=True, exist_ok=True)
    save_file(t, out / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((folder / "config.json").read_text())
    cfg.pop("quantization_config")
    (out / "config.json").write_text(json.dumps(cfg))
    for f in folder.iterdir():
        if f.suffix != ".safetensors" and f.name != "config.json":
            shutil.copy(f, out / f.name)
    return out


LAYER_PARTS = {  # engine layer attribute → its checkpoint modules (separate, or fused)
    "qkv": (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("self_attn.qkv_proj",)),
    "o": (("self_attn.o_proj",),),
    "gate_up": (("mlp.gate_proj", "mlp.up_proj"), ("mlp.gate_up_proj",)),
    "down": (("mlp.down_proj",),),
}


def check_engine_weights(model, ref: dict[str, torch.Tensor]) -> set[str]:
    """Assert every projection of the engine's ``model`` dequantizes (its method's
    ``dequantize_rows``, over the whole layer) to exactly the reference weights ``ref`` (module
    → [out, in]) of its modules concatenated; modules absent from ``ref`` must be float layers.
    Returns the modules compared (MoE experts each their own projection)."""
    from loramux.engine.model.quant.base import QuantLinear

    compared: set[str] = set()
    for i, layer in enumerate(model.layers):
        for attr, choices in LAYER_PARTS.items():
            lin = getattr(layer, attr, None) or getattr(layer.mlp, attr)
            lins, options = [lin], [choices]
            if isinstance(lin, list):  # MoE experts, one projection each (mlp.experts.<e>.)
                parts = [c.replace("mlp.", "") for c in choices[0]]
                lins, options = lin, [(tuple(f"mlp.experts.{e}.{n}" for n in parts),)
                                      for e in range(len(lin))]
            for one, opts in zip(lins, options, strict=True):
                compared |= _compare(one, opts, ref, f"model.layers.{i}.", QuantLinear)
    return compared | _compare(model.lm_head, [("lm_head",)], ref, "", QuantLinear)


def _compare(lin, choices, ref: dict[str, torch.Tensor], prefix: str, quant_type) -> set[str]:
    names = next((c for c in choices if prefix + c[0] in ref), None)
    if names is None:
        assert not isinstance(lin, quant_type), (prefix, choices)
        return set()
    want = torch.cat([ref[prefix + n] for n in names])
    got = lin.method.dequantize_rows(lin, 0, lin.out_features).float()
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    return {prefix + n for n in names}
