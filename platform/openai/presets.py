"""Adapter presets: the default sampling parameters a tenant stores with an adapter, which
fill what a request leaves out (``params.build_params`` merges them).

:func:`validate_preset` is the one validator (the adapter API, ``loramux adapters`` and,
through :func:`registry_preset_check`, the registry itself): a preset may hold what a
request may set by name (:data:`PRESET_FIELDS`), checked by the request schema and by
``SamplingParams``' own validation, so all three refuse the same presets with the same
words.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from loramux.engine.errors import SamplingParamError
from loramux.engine.sampling_params import SamplingParams
from loramux.platform.errors import BadRequest
from loramux.platform.openai.params import DIRECT_FIELDS, engine_values
from loramux.platform.openai.protocol import SamplingFields

PRESET_FIELDS = (frozenset(DIRECT_FIELDS) | {"logprobs"}) - {"prompt_logprobs"}
"""What an adapter preset may hold."""


def validate_preset(preset: Any) -> dict[str, Any]:
    """The one preset validator (HTTP API, CLI, and the registry through
    :func:`registry_preset_check`): the request schema plus SamplingParams' own checks;
    raises BadRequest naming the field."""
    if preset is None:
        return {}
    if not isinstance(preset, dict):
        raise BadRequest("preset must be a JSON object of sampling parameters", param="preset")
    unknown = sorted(set(preset) - PRESET_FIELDS)
    if unknown:
        raise BadRequest(
            f"preset: unknown sampling parameter {unknown[0]!r}; allowed: {sorted(PRESET_FIELDS)}",
            param=f"preset.{unknown[0]}",
        )
    try:
        SamplingFields.model_validate({k: v for k, v in preset.items() if k != "logprobs"})
        values = engine_values(dict(preset))
        SamplingParams(**values)
    except ValidationError as e:
        loc = e.errors()[0].get("loc", ())
        name = str(loc[0]) if loc else None
        raise BadRequest(f"preset: {e}", param=f"preset.{name}" if name else "preset") from None
    except SamplingParamError as e:
        raise BadRequest(f"preset: {e}", param=f"preset.{e.param}") from None
    return dict(preset)


def registry_preset_check(preset: dict[str, Any]) -> None:
    """:func:`validate_preset` as the registry's ``preset_check`` (raises InvalidPreset)."""
    from loramux.registry.errors import InvalidPreset

    try:
        validate_preset(preset)
    except BadRequest as e:
        raise InvalidPreset(e.message) from None
