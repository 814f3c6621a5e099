"""Default sampling presets stored with an adapter.

A preset is a JSON object of sampling parameters (vLLM / OpenAI names) that fills what a
request leaves out. The registry checks names, types and ranges so that a stored preset
never breaks requests later; the platform turns it into ``SamplingParams``.
"""

from __future__ import annotations

import json
import math
from typing import Any

from loramux.registry.errors import InvalidPreset

MAX_PRESET_BYTES = 4096

_FLOAT_RANGES: dict[str, tuple[float, float]] = {
    "temperature": (0.0, 100.0),
    "top_p": (1e-9, 1.0),
    "min_p": (0.0, 1.0),
    "presence_penalty": (-2.0, 2.0),
    "frequency_penalty": (-2.0, 2.0),
    "repetition_penalty": (1e-9, 100.0),
}
_INT_RANGES: dict[str, tuple[int, int]] = {
    "top_k": (-1, 1_000_000),
    "max_tokens": (1, 10_000_000),
    "min_tokens": (0, 10_000_000),
    "seed": (-(2**63), 2**63 - 1),
    "n": (1, 128),
    "logprobs": (0, 20),
}
_BOOLS = (
    "ignore_eos",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "include_stop_str_in_output",
)
ALLOWED_KEYS = (*_FLOAT_RANGES, *_INT_RANGES, *_BOOLS, "stop", "stop_token_ids", "logit_bias")


def _bad(key: str, why: str) -> InvalidPreset:
    return InvalidPreset(f"preset field {key!r}: {why}")


def check_preset(preset: Any) -> dict[str, Any] | None:
    """Return a validated copy of ``preset`` (``None`` or ``{}`` clears it)."""
    if preset is None:
        return None
    if not isinstance(preset, dict):
        raise InvalidPreset(f"a preset must be a JSON object, got {type(preset).__name__}")
    out: dict[str, Any] = {}
    for key, value in preset.items():
        if key not in ALLOWED_KEYS:
            raise _bad(key, f"unknown sampling parameter; allowed: {', '.join(ALLOWED_KEYS)}")
        if value is None:
            continue
        if key in _FLOAT_RANGES:
            lo, hi = _FLOAT_RANGES[key]
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise _bad(key, f"expected a number, got {value!r}")
            if not (math.isfinite(value) and lo <= value <= hi):
                raise _bad(key, f"{value!r} is outside [{lo:g}, {hi:g}]")
            out[key] = float(value)
        elif key in _INT_RANGES:
            lo, hi = _INT_RANGES[key]
            if isinstance(value, bool) or not isinstance(value, int):
                raise _bad(key, f"expected an integer, got {value!r}")
            if not lo <= value <= hi:
                raise _bad(key, f"{value!r} is outside [{lo}, {hi}]")
            out[key] = value
        elif key in _BOOLS:
            if not isinstance(value, bool):
                raise _bad(key, f"expected true or false, got {value!r}")
            out[key] = value
        elif key == "stop":
            stops = [value] if isinstance(value, str) else value
            if not (
                isinstance(stops, list)
                and len(stops) <= 16
                and all(isinstance(s, str) and s for s in stops)
            ):
                raise _bad(key, "expected a string or a list of up to 16 non-empty strings")
            out[key] = stops
        elif key == "stop_token_ids":
            if not (
                isinstance(value, list)
                and len(value) <= 64
                and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value)
            ):
                raise _bad(key, "expected a list of up to 64 token ids")
            out[key] = value
        elif key == "logit_bias":
            if not isinstance(value, dict) or len(value) > 300:
                raise _bad(key, "expected an object of up to 300 token id -> bias entries")
            bias = {}
            for token, b in value.items():
                if not str(token).isdigit():
                    raise _bad(key, f"token id {token!r} is not a non-negative integer")
                if isinstance(b, bool) or not isinstance(b, int | float) or not -100 <= b <= 100:
                    raise _bad(key, f"bias {b!r} for token {token} is outside [-100, 100]")
                bias[str(int(token))] = float(b)
            out[key] = bias
    if len(json.dumps(out)) > MAX_PRESET_BYTES:
        raise InvalidPreset(f"a preset may hold at most {MAX_PRESET_BYTES} bytes of JSON")
    return out or None
