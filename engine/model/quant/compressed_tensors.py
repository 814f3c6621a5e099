"""compressed-tensors checkpoints (llm-compressor's output, ``quant_method:
"compressed-tensors"``): integer weight-only schemes in the ``pack-quantized`` format, FP8
weights in the ``float-quantized`` / ``naive-quantized`` formats (``fp8.py``).

``quantization_config`` is read as the library writes it: ``config_groups`` (each a scheme:
``targets``, ``weights``, ``input_activations``, ``format``), the top-level ``format`` and
``ignore``. A target or an ignore entry is ``Linear`` (every projection), a module name, or
``re:<regex>`` matched from the start of the name; names are the loader's canonical ones
(``model.layers.<i>.self_attn.q_proj``, ``lm_head``). A quantized module's tensors are
``weight_packed`` (int32 [out, in·bits/32], see ``int_packed.py``), ``weight_scale``
([out, 1] per channel, [out, in / group_size] per group) and ``weight_shape`` ([out, in]).

Served: 4- and 8-bit integer weights, per channel or grouped (any group size dividing the input
features), symmetric or asymmetric (``weight_zero_point``: int32 [out·bits/32, G], packed along
the output dimension; unpacked to int8 [out, G] at load). Refused at start, naming the field:
integer activation quantization (W8A8), other formats (``int-quantized``, sparsity, NVFP4 /
MXFP4), ``actorder: group`` (``weight_g_idx``), a KV-cache scheme, transforms. FP8 schemes
that declare dynamic activation quantization load with the activations kept in the model's
dtype (no FP8 math on the CPU; logged at start).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from loramux.engine.errors import ModelLoadError
from loramux.engine.model.kernels import loader
from loramux.engine.model.quant.base import (
    QuantLinear,
    Shape,
    Take,
    UnquantizedMethod,
    WeightOnlyMethod,
)
from loramux.engine.model.quant.fp8 import (
    FLOAT_FORMATS,
    FloatScheme,
    dequantize_fp8_rows,
    parse_float_scheme,
    read_fp8,
)
from loramux.engine.model.quant.int_packed import (
    PACKED_BITS,
    KernelCall,
    dequantize_int,
    fp8_kernel_layout,
    kernel_dequantize,
    kernel_fits,
    kernel_layout,
    packed_columns,
    unpack_int32,
)

logger = logging.getLogger(__name__)

FORMATS = ("pack-quantized",)
"""The ``format`` values served."""
STORED = ("weight_packed", "weight_scale", "weight_shape")
"""A quantized module's tensors (and ``weight_zero_point`` when asymmetric), kept in their
stored dtypes."""
ZERO_POINT = "weight_zero_point"
PROJECTION = re.compile(r"(_proj|lm_head)$")
"""The modules a ``Linear`` target can name (a norm's ``.weight`` is never quantized)."""
KERNEL_DTYPES = (torch.float32, torch.bfloat16)
"""Activation and output dtypes the compiled kernel takes (others run the torch path)."""


@dataclass(frozen=True)
class IntScheme:
    """How one config group stores its weights."""

    num_bits: int
    """4 or 8."""
    group_size: int | None
    """Input features sharing one scale; None: one scale per output channel."""
    symmetric: bool = True
    """False: each scale has an integer zero point (``weight_zero_point``)."""

    def describe(self) -> str:
        return f"int{self.num_bits} " + (f"group {self.group_size}" if self.group_size
                                         else "per-channel") + (" symmetric" if self.symmetric
                                                                else " asymmetric")


@dataclass(frozen=True)
class ConfigGroup:
    """One entry of ``config_groups``: the modules it targets and their scheme."""

    name: str
    targets: tuple[str, ...]
    scheme: IntScheme | FloatScheme


def _refuse(source: str, field: str, value: Any, why: str) -> ModelLoadError:
    return ModelLoadError(f"{source}: quantization_config.{field} = {value!r}: {why}")


def _parse_group(name: str, group: Mapping[str, Any], top_format: Any, source: str) -> ConfigGroup:
    """One config group, every field checked (a refusal names the field)."""
    at = f"config_groups.{name}"
    targets = group.get("targets")
    if not targets or not all(isinstance(t, str) for t in targets):
        raise _refuse(source, f"{at}.targets", targets, "a list of module names is required")
    fmt = group.get("format") or top_format
    if fmt in FLOAT_FORMATS:
        return ConfigGroup(name, tuple(targets), parse_float_scheme(
            at, group, lambda field, value, why: _refuse(source, field, value, why)))
    if fmt not in FORMATS:
        raise _refuse(source, f"{at}.format", fmt, "supported formats: "
                      f"{', '.join(FORMATS + FLOAT_FORMATS)} (int4 / int8 weight-only, FP8 weights)")
    for key in ("input_activations", "output_activations"):
        if group.get(key) is not None:
            raise _refuse(source, f"{at}.{key}", "...", "activation quantization is not "
                          "supported (weight-only schemes: W4A16, W8A16)")
    w = group.get("weights")
    if not isinstance(w, Mapping):
        raise _refuse(source, f"{at}.weights", w, "a weight scheme is required")
    checks = (
        ("type", w.get("type") == "int", "supported: int"),
        ("num_bits", w.get("num_bits") in PACKED_BITS, "supported: 4, 8"),
        ("strategy", w.get("strategy") in ("channel", "group"), "supported: channel, group"),
        ("symmetric", w.get("symmetric", True) in (True, False), "true or false"),
        ("dynamic", not w.get("dynamic", False), "dynamic weight scales are not supported"),
        ("actorder", w.get("actorder") in (None, "weight", "static"),
         "activation-ordered groups (weight_g_idx) are not supported yet"),
        ("block_structure", w.get("block_structure") is None, "block scales are not supported"),
    )
    for key, ok, why in checks:
        if not ok:
            raise _refuse(source, f"{at}.weights.{key}", w.get(key), why)
    group_size = None
    if w["strategy"] == "group":
        group_size = w.get("group_size")
        if not isinstance(group_size, int) or group_size < 1:
            raise _refuse(source, f"{at}.weights.group_size", group_size, "a positive integer "
                          "is required with strategy group")
    return ConfigGroup(name, tuple(targets),
                       IntScheme(w["num_bits"], group_size, w.get("symmetric", True)))


def parse_config(qc: Mapping[str, Any], source: str) -> tuple[list[ConfigGroup], tuple[str, ...]]:
    """The config groups and ``ignore`` list of a compressed-tensors ``quantization_config``;
    raises :class:`ModelLoadError` naming the first field this engine does not serve."""
    status = qc.get("quantization_status", "compressed")
    if status != "compressed":
        raise _refuse(source, "quantization_status", status, "only compressed checkpoints load")
    for key in ("sparsity_config", "transform_config", "kv_cache_scheme"):
        if qc.get(key):
            raise _refuse(source, key, "...", "not supported")
    groups = qc.get("config_groups")
    if not isinstance(groups, Mapping) or not groups:
        raise _refuse(source, "config_groups", groups, "at least one config group is required")
    ignore = qc.get("ignore") or []
    if not isinstance(ignore, list) or not all(isinstance(i, str) for i in ignore):
        raise _refuse(source, "ignore", ignore, "a list of module names is required")
    parsed = [_parse_group(name, g, qc.get("format"), source) for name, g in groups.items()]
    return parsed, tuple(ignore)


def _matches(name: str, target: str) -> bool:
    if target == "Linear":
        return True
    if target.startswith("re:"):
        return re.match(target[3:], name) is not None
    return target == name


class CompressedTensorsMethod(WeightOnlyMethod):
    """compressed-tensors ``pack-quantized`` integer weights (module → scheme by the config's
    targets and ignore list; an ignored or untargeted module is a plain float ``.weight``)."""

    name = "compressed-tensors"

    def __init__(self, qc: Mapping[str, Any], source: str) -> None:
        self.source = source
        self._logged: set[tuple[IntScheme, str]] = set()  # which path each scheme runs, logged once
        self.groups, self.ignore = parse_config(qc, source)

    def describe(self) -> str:
        groups = "; ".join(f"{g.name}: {g.scheme.describe()} on {', '.join(g.targets)}"
                           for g in self.groups)
        formats = "pack-quantized" if all(isinstance(g.scheme, IntScheme) for g in self.groups) \
            else "float-quantized" if all(isinstance(g.scheme, FloatScheme) for g in self.groups) \
            else "mixed"
        return f"compressed-tensors {formats} ({groups}; ignore {list(self.ignore)})"

    def scheme_of(self, module: str) -> IntScheme | FloatScheme | None:
        """The scheme of canonical module ``module`` (None: stored unquantized)."""
        if any(_matches(module, i) for i in self.ignore):
            return None
        found = [g for g in self.groups if any(_matches(module, t) for t in g.targets)]
        if len(found) > 1:
            raise ModelLoadError(f"{self.source}: module {module} is targeted by config groups "
                                 f"{[g.name for g in found]}; one scheme per module is required")
        return found[0].scheme if found else None

    def keeps_stored_dtype(self, name: str) -> bool:
        module, suffix = name.rsplit(".", 1) if "." in name else ("", name)
        if suffix == "weight":  # an FP8 projection's weight stays FP8
            return PROJECTION.search(module) is not None and isinstance(self.scheme_of(module),
                                                                        FloatScheme)
        return suffix in (*STORED, ZERO_POINT)

    def create_linear(self, modules: Sequence[str], take: Take, bias: torch.Tensor | None, *,
                      shapes: Sequence[Shape], dtype: torch.dtype):
        schemes = {self.scheme_of(m) for m in modules}
        if len(schemes) > 1:
            raise ModelLoadError(f"{self.source}: modules {list(modules)} run fused and need one "
                                 f"scheme; the config gives them {sorted(map(str, schemes))}")
        scheme = schemes.pop()
        if scheme is None:
            return UnquantizedMethod().create_linear(modules, take, bias, shapes=shapes, dtype=dtype)
        if isinstance(scheme, FloatScheme):
            return self._fp8_linear(modules, scheme, take, bias, shapes, dtype)
        parts = [self._read(m, scheme, shape, take) for m, shape in zip(modules, shapes, strict=True)]
        in_features = {k for _, k in parts}
        if len(in_features) > 1:
            raise ModelLoadError(f"{self.source}: fused modules {list(modules)} have different "
                                 f"input features {sorted(in_features)}")
        params = {name: torch.cat([p[name] for p, _ in parts]) if len(parts) > 1 else parts[0][0][name]
                  for name in parts[0][0]}  # along the output rows: [out, words | G] each
        k, out = in_features.pop(), params["weight_packed"].shape[0]
        if self._runs_kernel(scheme, params["weight_packed"].device):
            params = self._repack(params, scheme, k)
        return QuantLinear(self, params, bias, out_features=out, in_features=k, dtype=dtype,
                           scheme=scheme)

    def _fp8_linear(self, modules: Sequence[str], scheme: FloatScheme, take: Take,
                    bias: torch.Tensor | None, shapes: Sequence[Shape], dtype: torch.dtype):
        """A projection of FP8 weights (``fp8.py``): on the CPU the compiled kernel's layout
        (``loramux::wq_linear`` widens each byte exactly), elsewhere a band of rows dequantized
        at a time."""
        parts = [read_fp8(m, scheme, shape, take, self._bad) for m, shape in zip(modules, shapes,
                                                                                  strict=True)]
        in_features = {p["weight"].shape[1] for p in parts}
        if len(in_features) > 1:
            raise ModelLoadError(f"{self.source}: fused modules {list(modules)} have different "
                                 f"input features {sorted(in_features)}")
        params = {n: torch.cat([p[n] for p in parts]) if len(parts) > 1 else parts[0][n]
                  for n in parts[0]}
        out = params["weight"].shape[0]
        # the kernel's layout only; but a float32 model of 16-bit scales keeps the torch path:
        # the library rounds each weight to the scales' dtype, the kernel's float32 sums do not
        rounds = dtype == torch.float32 and params["weight_scale"].dtype != torch.float32
        if not rounds and self._runs_kernel(scheme, params["weight"].device):
            params = fp8_kernel_layout(params["weight"], params["weight_scale"])
        elif (scheme, "fp8-torch") not in self._logged:
            self._logged.add((scheme, "fp8-torch"))
            logger.info("quantized linears (%s): torch dequantize-then-matmul, a band of rows at "
                        "a time into %s", scheme.describe(), dtype)
        return QuantLinear(self, params, bias, out_features=out, in_features=in_features.pop(),
                           dtype=dtype, scheme=scheme)

    def _runs_kernel(self, scheme: IntScheme | FloatScheme, device: torch.device) -> bool:
        """Whether this projection runs the compiled kernel (``loramux::wq_linear``); logs
        once per scheme which path runs (without it the torch dequantize-then-matmul runs instead)."""
        if device.type != "cpu":
            return False
        why = (f"CPU kernels {loader.status().state}" if not loader.available()
               else None if kernel_fits(scheme.group_size)
               else f"group size {scheme.group_size} is not a multiple of 32")
        note = (f"torch dequantize-then-matmul ({why})" if why
                else f"loramux::wq_linear ({loader.status().isa} variant)")
        if (scheme, note) not in self._logged:
            self._logged.add((scheme, note))
            logger.info("quantized linears (%s): %s", scheme.describe(), note)
        return why is None

    @staticmethod
    def _repack(params: dict[str, torch.Tensor], scheme: IntScheme, k: int) -> dict[str, torch.Tensor]:
        """The checkpoint's tensors in the kernel's layout (``int_packed.kernel_layout``), a
        band of rows at a time (the unpacked int32 values of a band only)."""
        packed, scale, zp = params["weight_packed"], params["weight_scale"], params.get(ZERO_POINT)
        rows = max(1, (1 << 20) // k)
        bands = [kernel_layout(unpack_int32(packed[r:r + rows], scheme.num_bits, k), scale[r:r + rows],
                               zp[r:r + rows] if zp is not None else None, scheme.num_bits)
                 for r in range(0, packed.shape[0], rows)]
        return {name: torch.cat([b[name] for b in bands]) for name in bands[0]}

    def _read(self, module: str, scheme: IntScheme, shape: Shape,
              take: Take) -> tuple[dict[str, torch.Tensor], int]:
        """One module's tensors (``weight_packed`` [out, words], ``weight_scale`` [out, G],
        ``weight_zero_point`` int8 [out, G] when asymmetric) and its input features, checked
        against each other, the scheme and the config's shape."""
        p = module + "."
        packed, scale, stored = (take(p + n) for n in STORED)
        stored_shape = [int(v) for v in stored.flatten().tolist()]
        if len(stored_shape) != 2 or (shape is not None and tuple(stored_shape) != tuple(shape)):
            raise self._bad(p + "weight_shape", f"is {stored_shape}; the model's config makes "
                            f"this weight {list(shape) if shape else '[out, in]'}")
        out, k = stored_shape
        words = packed_columns(k, scheme.num_bits)
        if packed.dtype != torch.int32 or tuple(packed.shape) != (out, words):
            raise self._bad(p + "weight_packed", f"is {packed.dtype} {list(packed.shape)}; an "
                            f"int{scheme.num_bits} [{out}, {k}] weight packs to int32 [{out}, {words}]")
        g = scheme.group_size
        if g is not None and k % g:
            raise self._bad(p + "weight_scale", f"group_size {g} does not divide the {k} input "
                            "features")
        want = (out, k // g if g else 1)
        if not scale.is_floating_point() or tuple(scale.shape) != want:
            kind = f"group_size {g}" if g else "per-channel"
            raise self._bad(p + "weight_scale", f"is {scale.dtype} {list(scale.shape)}; a {kind} "
                            f"scale of a [{out}, {k}] weight is a float {list(want)}")
        if not bool(torch.isfinite(scale).all()):
            raise self._bad(p + "weight_scale", "holds non-finite values")
        params = {"weight_packed": packed, "weight_scale": scale}
        if not scheme.symmetric:
            params[ZERO_POINT] = self._zero_point(p, take(p + ZERO_POINT), scheme, want)
        return params, k

    def _zero_point(self, p: str, zp: torch.Tensor, scheme: IntScheme,
                    want: tuple[int, int]) -> torch.Tensor:
        """``weight_zero_point`` int32 [out·bits/32, G] (packed along the output rows) →
        int8 [out, G]."""
        out, groups = want
        words = packed_columns(out, scheme.num_bits)
        if zp.dtype != torch.int32 or tuple(zp.shape) != (words, groups):
            raise self._bad(p + ZERO_POINT, f"is {zp.dtype} {list(zp.shape)}; {out} rows of "
                            f"int{scheme.num_bits} zero points pack to int32 [{words}, {groups}]")
        return unpack_int32(zp.T.contiguous(), scheme.num_bits, out).T.to(torch.int8).contiguous()

    def _bad(self, tensor: str, why: str) -> ModelLoadError:
        return ModelLoadError(f"{self.source}: tensor {tensor} {why}")

    def apply(self, layer: QuantLinear, x: torch.Tensor) -> torch.Tensor:
        """The compiled kernel where the layer was repacked for it and the kernels are on;
        else the torch path (dequantize a band, matmul), the reference."""
        if ("kernel_weight" in layer.params and x.device.type == "cpu" and loader.available()
                and x.dtype in KERNEL_DTYPES and layer.dtype in KERNEL_DTYPES):
            if layer.kernel_calls is None:
                scheme: IntScheme | FloatScheme = layer.scheme
                layer.kernel_calls = [(None, KernelCall(layer.params, scheme.num_bits, layer.in_features,
                                                        scheme.group_size, layer.bias, layer.dtype))]
            return layer.call_kernels(x)
        return super().apply(layer, x)

    def dequantize_rows(self, layer: QuantLinear, start: int, stop: int) -> torch.Tensor:
        if isinstance(layer.scheme, FloatScheme):
            if "kernel_weight" in layer.params:  # the kernel's layout
                return kernel_dequantize(layer.params, 8, layer.in_features, None, start, stop)
            return dequantize_fp8_rows(layer.params, start, stop)
        scheme: IntScheme = layer.scheme
        if "kernel_weight" in layer.params:  # repacked at load for the kernel
            return kernel_dequantize(layer.params, scheme.num_bits, layer.in_features,
                                     scheme.group_size, start, stop)
        values = unpack_int32(layer.params["weight_packed"][start:stop], scheme.num_bits,
                              layer.in_features)  # [n, in]
        zp = layer.params.get(ZERO_POINT)  # [out, G] int8, or None
        return dequantize_int(values, layer.params["weight_scale"][start:stop], scheme.group_size,
                              zp[start:stop] if zp is not None else None)


METHOD = CompressedTensorsMethod
"""The method class ``select.quant_method`` builds for ``quant_method: compressed-tensors``."""
