"""LoRA on the experts of an MoE base: PEFT's ``target_parameters`` on the fused 3-D expert
weights of transformers 5 (``mlp.experts.gate_up_proj`` [E, 2I, H], ``mlp.experts.down_proj``
[E, H, I]), as PEFT 0.17+ trains and saves them (``lora.ParamWrapper``).

PEFT's layout, per MoE layer and parameter: ``lora_A`` ``[E * r, in]`` (expert-major: rows
``e * r … e * r + r`` are expert e's A) and ``lora_B`` ``[out, r * E]`` (rank-major: column
``k * E + e`` is rank k of expert e); expert e's weight becomes ``W_e + scale * B_e @ A_e``.
When an adapter targets both parameters PEFT nests the wrappers in the order the experts
module defines them, so ``gate_up_proj``'s tensors are named ``mlp.experts.base_layer.lora_*``
and ``down_proj``'s ``mlp.experts.lora_*``; with one parameter its tensors are
``mlp.experts.lora_*``. PEFT turns ``target_modules`` naming ``gate_proj`` / ``up_proj`` /
``down_proj`` on an MoE model into these parameters, ``gate_up_proj`` at twice the rank
(``rank_pattern`` / ``alpha_pattern`` ``{".*\\.gate_up_proj": 2 r}``), which is accepted here.

Loaded, each layer's experts LoRA is ``(A [E, r, in], B [E, out, r])`` per parameter
(``LoraWeights.experts``); :func:`peft_tensors` turns it back into PEFT's tensors.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

import torch

from loramux.adapters.errors import AdapterValidationError

EXPERT_PARAMS = ("gate_up_proj", "down_proj")
"""The expert parameters LoRA may target, in the order PEFT nests their wrappers."""
ROUTER = "router"
"""The router's weight (``mlp.gate.weight`` [E, H]; PEFT's ``all-linear`` targets it on MoE
bases): a plain 2-D LoRA, A ``[r, H]``, B ``[E, r]``, adding ``scale * B @ A @ x`` to the
router logits. Kept in ``LoraWeights.experts[i]["router"]`` as ``(A, B)``."""
ROUTER_KEY_RE = re.compile(
    r"^base_model\.model\.model\.layers\.(?P<layer>\d{1,6})\.mlp\.gate\.lora_(?P<which>[AB])\.weight$"
)
EXPERT_KEY_RE = re.compile(
    r"^base_model\.model\.(?P<prefix>model\.)layers\.(?P<layer>\d{1,6})\.mlp\.experts\."
    r"(?P<base>base_layer\.)?lora_(?P<which>[AB])\.weight$"
)
_PARAM_RE = re.compile(
    r"^(?:(?:model\.)?layers\.\d{1,6}\.)?(?:(?:mlp|block_sparse_moe)\.)?(?:experts\.)?(?P<param>[A-Za-z0-9_.]+)$"
)
# rank_pattern / alpha_pattern keys accepted for the expert parameters (no regex is evaluated)
_PATTERN_KEY_RE = re.compile(r"^(?:\.\*\\?\.)?(?:mlp\\?\.experts\\?\.)?(?P<param>gate_up_proj|down_proj)$")


def refuse(field_name: str, message: str) -> AdapterValidationError:
    return AdapterValidationError(f"{field_name}: {message}", field=field_name)


def parse_target_parameters(config: Mapping[str, Any], base) -> tuple[str, ...]:
    """The expert parameters an ``adapter_config.json`` targets (canonical names, in
    :data:`EXPERT_PARAMS` order); ``base``: the served base's dims (None: any MoE base)."""
    value = config.get("target_parameters")
    if value in (None, []):
        return ()
    if not isinstance(value, list | tuple):
        raise refuse("target_parameters", f"expected a list of parameter names, got {value!r}")
    if base is not None and not base.family.moe:
        raise refuse("target_parameters", f"LoRA on parameters ({list(value)[:3]}) needs a "
                     f"mixture-of-experts base; the base model is {base.family.title}")
    params = set()
    for entry in value:
        m = _PARAM_RE.match(entry) if isinstance(entry, str) else None
        param = m["param"] if m else None
        if param == "gate.weight":
            params.add(ROUTER)
            continue
        if param not in EXPERT_PARAMS:
            raise refuse("target_parameters", f"{entry!r} is not an expert parameter of the base "
                         f"model; supported: {', '.join('mlp.experts.' + p for p in EXPERT_PARAMS)}, "
                         f"mlp.gate.weight (the router)")
        params.add(param)
    if config.get("layers_to_transform") not in (None, []):
        raise refuse("layers_to_transform", "layers_to_transform with target_parameters is not "
                     "supported (PEFT targets the parameters in every layer)")
    return tuple(p for p in (*EXPERT_PARAMS, ROUTER) if p in params)


def parameter_ranks(config: Mapping[str, Any], params: tuple[str, ...], r: int,
                    alpha: float) -> tuple[tuple[str, int, float], ...]:
    """``(param, rank, alpha)`` of each targeted expert parameter: ``r`` / ``lora_alpha`` unless
    ``rank_pattern`` / ``alpha_pattern`` name the parameter (the only keys accepted there)."""
    patterns: dict[str, dict[str, Any]] = {}
    for key in ("rank_pattern", "alpha_pattern"):
        value = config.get(key) or {}
        if not isinstance(value, Mapping):
            raise refuse(key, f"expected an object, got {value!r}")
        for k, v in value.items():
            m = _PATTERN_KEY_RE.match(k) if isinstance(k, str) else None
            if m is None or m["param"] not in params:
                raise refuse(key, f"per-module ranks or alphas are not supported ({k!r}); only the "
                             f"targeted expert parameters {list(params)} may have their own")
            ok = (isinstance(v, int) and v > 0) if key == "rank_pattern" else (
                isinstance(v, int | float) and math.isfinite(v) and v > 0)
            if isinstance(v, bool) or not ok:
                raise refuse(key, f"{k!r}: expected a positive number, got {v!r}")
            patterns.setdefault(m["param"], {})[key] = v
    return tuple((p, int(patterns.get(p, {}).get("rank_pattern", r)),
                  float(patterns.get(p, {}).get("alpha_pattern", alpha))) for p in params)


def expert_shapes(dims) -> dict[str, tuple[int, int]]:
    """``(in_features, out_features)`` of each expert parameter of the base (and the router's)."""
    h, i = dims.hidden_size, dims.moe_intermediate_size
    return {"gate_up_proj": (h, 2 * i), "down_proj": (i, h), ROUTER: (h, dims.num_experts)}


def tensor_names(spec, layer: int, prefix: str = "model.") -> dict[str, tuple[str, str]]:
    """PEFT's ``(lora_A, lora_B)`` names of each targeted parameter of one layer."""
    out = {}
    experts = [p for p in spec.target_parameters if p != ROUTER]
    for p in spec.target_parameters:
        if p == ROUTER:
            stem = f"base_model.model.{prefix}layers.{layer}.mlp.gate."
            out[p] = (stem + "lora_A.weight", stem + "lora_B.weight")
            continue
        base = "base_layer." if p == "gate_up_proj" and len(experts) > 1 else ""
        stem = f"base_model.model.{prefix}layers.{layer}.mlp.experts.{base}"
        out[p] = (stem + "lora_A.weight", stem + "lora_B.weight")
    return out


def collect(infos: Mapping[str, Any], spec) -> tuple[dict[tuple[int, str], dict[str, Any]], set[str]]:
    """The experts' tensors by (layer, parameter) and their names (the other tensors are
    the modules'). Refuses expert tensors the config does not target."""
    found: dict[tuple[int, str], dict[str, Any]] = {}
    names = set()
    experts = [p for p in spec.target_parameters if p != ROUTER]
    for key, info in infos.items():
        router = ROUTER_KEY_RE.match(key)
        m = router or EXPERT_KEY_RE.match(key)
        if m is None:
            continue
        if router is not None:
            if ROUTER not in spec.target_parameters:
                raise refuse(key, "unexpected tensor: target_parameters does not name mlp.gate.weight")
            found.setdefault((int(m["layer"]), ROUTER), {})[m["which"]] = info
            names.add(key)
            continue
        if not experts:
            raise refuse(key, "unexpected tensor: target_parameters names no expert parameter")
        if m["base"] and len(experts) < 2:
            raise refuse(key, f"unexpected tensor: with target_parameters {list(spec.target_parameters)} "
                         f"the experts' tensors are named mlp.experts.lora_A/B")
        param = "gate_up_proj" if m["base"] else experts[-1]
        found.setdefault((int(m["layer"]), param), {})[m["which"]] = info
        names.add(key)
    return found, names


def check(found, spec, dims, hint: str = "") -> None:
    """Every MoE layer has both tensors of every targeted parameter, in the base's expert
    shapes: a 422 names the tensor and the shape expected (experts × rank, in / out)."""
    if dims is None:
        return
    if spec.target_parameters and not dims.family.moe:
        raise refuse("target_parameters", f"the base model ({dims.family.title}) has no experts")
    shapes = expert_shapes(dims)
    e = dims.num_experts
    for (layer, param) in found:
        if layer not in dims.moe_layers:
            name = next(iter(found[(layer, param)].values())).name
            raise refuse(name, f"unexpected tensor: layer {layer} of the base model has no experts "
                         f"(MoE layers: {list(dims.moe_layers)})")
    for layer in dims.moe_layers:
        for param, (a_name, b_name) in tensor_names(spec, layer).items():
            pair = found.get((layer, param), {})
            for which, name in (("A", a_name), ("B", b_name)):
                if which not in pair:
                    raise refuse(name, f"missing tensor (LoRA on mlp.experts.{param})")
            r = spec.expert_rank(param)
            k, n = shapes[param]
            experts = 1 if param == ROUTER else e
            for which, want in (("A", (experts * r, k)), ("B", (n, r * experts))):
                got = tuple(pair[which].shape)
                if got != want:
                    raise AdapterValidationError(
                        f"{pair[which].name}: shape {list(got)}, expected {list(want)} for "
                        f"{'the router mlp.gate.weight (rank' if param == ROUTER else f'mlp.experts.{param} ({e} experts × rank'} {r}, "
                        f"{'in' if which == 'A' else 'out'} features {want[1] if which == 'A' else want[0]})"
                        f"{hint}", field=pair[which].name)


def to_experts(a: torch.Tensor, b: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """PEFT's ``A [E r, in]``, ``B [out, r E]`` → ``A [E, r, in]``, ``B [E, out, r]``."""
    r = a.shape[0] // num_experts
    return (a.reshape(num_experts, r, a.shape[1]).contiguous(),
            b.reshape(b.shape[0], r, num_experts).permute(2, 0, 1).contiguous())


def peft_tensors(weights, prefix: str = "model.") -> dict[str, torch.Tensor]:
    """The experts' LoRA of ``weights`` as PEFT's tensors (the inverse of :func:`to_experts`)."""
    out = {}
    for layer, params in weights.experts.items():
        names = tensor_names(weights.spec, layer, prefix)
        for param, (a, b) in params.items():
            if param == ROUTER:
                out[names[param][0]], out[names[param][1]] = a.contiguous(), b.contiguous()
                continue
            e, r = a.shape[0], a.shape[1]
            out[names[param][0]] = a.reshape(e * r, a.shape[2]).contiguous()
            out[names[param][1]] = b.permute(1, 2, 0).reshape(b.shape[1], r * e).contiguous()
    return out


def delta(a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """The experts' weight delta ``[E, out, in]`` (``scale * B_e @ A_e``), for merging."""
    return torch.bmm(b, a) * scale
