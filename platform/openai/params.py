"""Request body + adapter preset (:mod:`.presets`) → :class:`SamplingParams`, and what to
tell the caller.

Precedence: the engine's defaults < the adapter's stored preset < the fields the
request sets. The result names the parameters in effect (sent back in the
``X-LoRAMux-Params`` header), which of them came from the preset, and a warning
for every parameter that had no effect.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from typing import Any

from loramux.engine.beam_search import BEAM_SEARCH_READS
from loramux.engine.errors import SamplingParamError
from loramux.engine.sampling_params import SamplingParams
from loramux.engine.structured_params import StructuredOutputsParams
from loramux.platform.errors import BadRequest
from loramux.platform.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    SamplingFields,
)

# The one sampling schema is the engine's SamplingParams; everything below derives from it.
_ENGINE_ONLY = frozenset({"detokenize", "structured_outputs", "logprobs"})
"""SamplingParams fields a request does not set by name (``logprobs`` has a shape of its
own per endpoint; ``structured_outputs`` comes from several request fields)."""
ENGINE_FIELDS = tuple(f.name for f in fields(SamplingParams) if f.init)
DIRECT_FIELDS = tuple(n for n in ENGINE_FIELDS if n not in _ENGINE_ONLY)
"""Request fields that map 1:1 onto SamplingParams."""
BEAM_IGNORED = tuple(n for n in ENGINE_FIELDS if n not in BEAM_SEARCH_READS)
"""Sampling parameters beam search does not use (each gets a warning when set with it)."""
_NOT_SHOWN = frozenset({"spaces_between_special_tokens"})  # no effect: reported as a warning
_SHOWN = tuple(n for n in ENGINE_FIELDS if n not in _NOT_SHOWN and n not in _ENGINE_ONLY - {"logprobs"})
"""The parameters the ``X-LoRAMux-Params`` header reports."""
_undeclared = set(DIRECT_FIELDS) - set(SamplingFields.model_fields)
if _undeclared:  # a new SamplingParams field needs its request type in protocol.py
    raise ImportError(f"SamplingFields lacks SamplingParams fields {sorted(_undeclared)}")
_MAX_HEADER = 4000
MAX_N = 128
"""Most completions (``n``, ``best_of``) one request may ask for."""


@dataclass
class BuiltParams:
    """The SamplingParams of a request and what the response reports about them."""

    params: SamplingParams
    preset_fields: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    def effective(self) -> dict[str, Any]:
        p = self.params
        out: dict[str, Any] = {}
        for name in _SHOWN:
            value = getattr(p, name)
            if name == "stop":
                value = list(p.stop_strings)
            if name in ("logit_bias", "allowed_token_ids") and not value:
                continue
            if name == "logit_bias":
                value = {str(k): v for k, v in value.items()}
            out[name] = value
        return out

    def headers(self) -> dict[str, str]:
        """``X-LoRAMux-Params`` (JSON of the parameters in effect), ``X-LoRAMux-Preset``
        (the fields the adapter's preset supplied) and ``X-LoRAMux-Warnings`` (JSON list)."""
        eff = self.effective()
        text = _compact(eff)
        if len(text) > _MAX_HEADER:
            for key in ("logit_bias", "allowed_token_ids", "stop_token_ids", "stop"):
                if key in eff and isinstance(eff[key], (list, dict)):
                    eff[key] = f"<{len(eff[key])} items>"
            text = _compact(eff)
        headers = {"X-LoRAMux-Params": text[:_MAX_HEADER]}
        if self.preset_fields:
            headers["X-LoRAMux-Preset"] = ",".join(self.preset_fields)
        if self.warnings:
            headers["X-LoRAMux-Warnings"] = _compact(self.warnings)[: _MAX_HEADER]
        return headers


def _compact(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=True)


def engine_values(values: dict[str, Any]) -> dict[str, Any]:
    """Request values as SamplingParams takes them (``logit_bias`` keys as token ids, a
    negative ``seed`` folded into the generator's range)."""
    bias = values.get("logit_bias")
    if bias:
        try:
            values["logit_bias"] = {int(k): float(v) for k, v in bias.items()}
        except (TypeError, ValueError, AttributeError):
            raise SamplingParamError(
                "logit_bias", f"logit_bias must map integer token ids to numbers, got {bias!r}."
            ) from None
    seed = values.get("seed")
    if isinstance(seed, int) and not isinstance(seed, bool) and seed < 0:
        values["seed"] = seed + 2**63  # a per-request generator needs a non-negative seed
    return values


def build_params(
    req: CompletionRequest | ChatCompletionRequest,
    preset: dict[str, Any] | None,
    *,
    default_max_tokens: int | None,
    tool_constraint: StructuredOutputsParams | None = None,
) -> BuiltParams:
    """Merge engine defaults, the adapter preset and the request's own fields.
    ``tool_constraint``: the grammar a chat request's ``tool_choice`` imposes; it replaces
    the request's own output constraint (reported as a warning), as in vLLM."""
    is_chat = isinstance(req, ChatCompletionRequest)
    given = {
        name: getattr(req, name)
        for name in req.model_fields_set
        if name in DIRECT_FIELDS and getattr(req, name) is not None
    }
    warnings: list[str] = []
    if req.max_completion_tokens is not None:
        if "max_tokens" in given and given["max_tokens"] != req.max_completion_tokens:
            warnings.append("max_tokens had no effect: max_completion_tokens was also set and wins")
        given["max_tokens"] = req.max_completion_tokens
    if is_chat:
        if req.logprobs:
            given["logprobs"] = req.top_logprobs or 0
        elif req.top_logprobs is not None:
            warnings.append("top_logprobs had no effect: set logprobs to true to get logprobs")
    elif req.logprobs is not None:
        given["logprobs"] = req.logprobs

    structured = _structured_outputs(req)
    if tool_constraint is not None:
        if structured is not None:
            warnings.append("the request's output constraint had no effect: tool_choice "
                            "constrains the output to tool calls")
        structured = tool_constraint
    if structured is not None:
        given["structured_outputs"] = structured

    values: dict[str, Any] = {"max_tokens": default_max_tokens}
    preset = dict(preset or {})
    preset_fields = sorted(k for k in preset if k not in given)
    values.update(preset)
    values.update(given)
    for name in ("n", "best_of"):
        value = values.get(name)
        if isinstance(value, int) and value > MAX_N:
            raise BadRequest(f"{name} must be at most {MAX_N}, got {value}.", param=name,
                             code="invalid_parameter")
    try:
        params = SamplingParams(**engine_values(values))
    except SamplingParamError:
        raise  # the error table's 400 naming the parameter
    except ValueError as e:  # a nested value SamplingParams could not take
        raise BadRequest(str(e), code="invalid_parameter") from None
    except TypeError as e:  # a preset holding something SamplingParams cannot take
        raise BadRequest(f"invalid sampling parameters: {e}") from None

    warnings += _no_effect(req, params, given, is_chat)
    return BuiltParams(params, preset_fields, warnings)


_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
           "guided_grammar": "grammar"}


def _structured_outputs(req) -> StructuredOutputsParams | None:
    """The request's output constraint from ``response_format`` (OpenAI), ``structured_outputs``
    or the ``guided_*`` fields (vLLM); at most one may be given."""
    found: list[tuple[str, dict[str, Any]]] = []
    fmt = req.response_format
    if fmt is not None:
        kind = fmt.get("type") if isinstance(fmt, dict) else None
        if kind == "json_object":
            found.append(("response_format", {"json_object": True}))
        elif kind == "json_schema":
            schema = (fmt.get("json_schema") or {}).get("schema")
            if not isinstance(schema, dict):
                raise BadRequest("response_format.json_schema.schema must be a JSON schema object",
                                 param="response_format")
            found.append(("response_format", {"json": schema}))
        elif kind != "text":
            raise BadRequest(
                f"response_format.type must be text, json_object or json_schema, got {kind!r}",
                param="response_format",
            )
    if req.structured_outputs is not None:
        found.append(("structured_outputs", dict(req.structured_outputs)))
    for name, key in _GUIDED.items():
        value = getattr(req, name)
        if value is not None:
            found.append((name, {key: value}))
    if not found:
        return None
    if len(found) > 1:
        names = ", ".join(n for n, _ in found)
        raise BadRequest(f"give one output constraint, not several ({names})", param=found[1][0])
    name, spec = found[0]
    try:
        return StructuredOutputsParams(**spec)
    except (TypeError, ValueError) as e:
        raise BadRequest(f"{name}: {e}", param=name) from None


def _no_effect(req, params: SamplingParams, given: dict[str, Any], is_chat: bool) -> list[str]:
    out: list[str] = []
    if params.use_beam_search:
        out += [f"{name} had no effect: beam search ranks beams by logprob and does not sample"
                for name in BEAM_IGNORED if name in given]
    else:
        out += [f"{name} had no effect: use_beam_search is not set"
                for name in ("length_penalty", "early_stopping") if name in given]
    if params.is_greedy and not params.use_beam_search:
        for name, neutral in (("top_p", 1.0), ("top_k", 0), ("min_p", 0.0)):
            if name in given and given[name] != neutral and not (name == "top_k" and given[name] == -1):
                out.append(f"{name} had no effect: temperature is 0 (greedy decoding)")
        if "seed" in given:
            out.append("seed had no effect: temperature is 0 (greedy decoding)")
    if given.get("spaces_between_special_tokens") is False:
        out.append("spaces_between_special_tokens had no effect: special tokens are decoded "
                   "as the tokenizer joins them")
    if given.get("include_stop_str_in_output") and not params.stop_strings:
        out.append("include_stop_str_in_output had no effect: no stop strings are set")
    if req.stream_options is not None and not req.stream:
        out.append("stream_options had no effect: stream is false")
    if getattr(req, "suffix", None):
        out.append("suffix had no effect: insertion is not supported")
    for name in sorted(req.model_extra or {}):
        out.append(f"{name} had no effect: it is not a recognized parameter")
    return out
