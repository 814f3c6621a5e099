"""Default sampling presets stored with an adapter: how the registry keeps them.

A preset is a JSON object of sampling parameters (vLLM / OpenAI names) that fills what a
request leaves out. *Which* parameters and values are valid is the serving side's
business: the platform derives its one preset validator from the engine's
``SamplingParams`` and hands it to the registry (``preset_check``), so the HTTP API,
the CLI and the registry refuse the same presets with the same words. The registry
itself only makes sure that what it stores is a small JSON object, with ``stop``
normalized to a list.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from loramux.registry.errors import InvalidPreset

MAX_PRESET_BYTES = 4096

PresetCheck = Callable[[dict[str, Any]], Any]
"""Validates a preset's parameters; raises :class:`InvalidPreset` naming the field."""


def check_preset(preset: Any, validate: PresetCheck | None = None) -> dict[str, Any] | None:
    """A stored copy of ``preset`` (``None`` or ``{}`` clears it), after ``validate``."""
    if preset is None:
        return None
    if not isinstance(preset, dict):
        raise InvalidPreset(f"a preset must be a JSON object, got {type(preset).__name__}")
    if validate is not None:
        validate(preset)
    out = {k: v for k, v in preset.items() if v is not None}
    if isinstance(out.get("stop"), str):
        out["stop"] = [out["stop"]]
    try:
        text = json.dumps(out)
    except (TypeError, ValueError) as e:
        raise InvalidPreset(f"a preset must be plain JSON: {e}") from None
    if len(text) > MAX_PRESET_BYTES:
        raise InvalidPreset(f"a preset may hold at most {MAX_PRESET_BYTES} bytes of JSON")
    return out or None
