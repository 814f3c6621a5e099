"""The request's ``tools`` as the parsers read them, and schema-driven value coercion.

A request is anything with optional ``tools`` and ``tool_choice`` attributes (loramux's
pydantic ``ChatCompletionRequest``, a test double, or ``None``). A tool is the OpenAI
``{"type": "function", "function": {"name", "parameters"}}`` dict, a Responses API
flat ``{"type": "function", "name", "parameters"}`` dict, or an object with the same
attributes.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import Any


def _get(obj: Any, key: str) -> Any:
    if isinstance(obj, dict):
        return obj.get(key)
    return getattr(obj, key, None)


def request_tools(request: Any) -> list[Any]:
    """The request's tools, or ``[]``."""
    return list(_get(request, "tools") or []) if request is not None else []


def calls_suppressed(request: Any) -> bool:
    """``tool_choice: "none"`` with tools: vLLM's engine-based parsers then keep the
    text outside calls as content and return no calls."""
    return _get(request, "tool_choice") == "none" and bool(request_tools(request))


def tool_name(tool: Any) -> str | None:
    function = _get(tool, "function")
    if function is not None:
        return _get(function, "name")
    return _get(tool, "name")


def tool_parameters(tool: Any) -> dict | None:
    function = _get(tool, "function")
    params = _get(function, "parameters") if function is not None else _get(tool, "parameters")
    return params if isinstance(params, dict) else None


def find_tool_properties(tools: Sequence[Any], name: str) -> dict:
    """The ``parameters.properties`` of the tool called ``name`` (``{}`` if none)."""
    for tool in tools:
        if tool_name(tool) == name:
            params = tool_parameters(tool) or {}
            props = params.get("properties")
            return props if isinstance(props, dict) else {}
    return {}


def extract_types_from_schema(schema: Any) -> list[str]:
    """Every JSON type a schema allows (``type``, ``enum`` values, ``anyOf``/``oneOf``/
    ``allOf``), or ``["string"]`` when it says none."""
    if not isinstance(schema, dict):
        return ["string"]
    types: set[str] = set()
    declared = schema.get("type")
    if isinstance(declared, str):
        types.add(declared)
    elif isinstance(declared, list):
        types.update(t for t in declared if isinstance(t, str))
    enum = schema.get("enum")
    if isinstance(enum, list):
        for value in enum:
            types.add(_json_type_of(value))
    for key in ("anyOf", "oneOf", "allOf"):
        choices = schema.get(key)
        if isinstance(choices, list):
            for choice in choices:
                types.update(extract_types_from_schema(choice))
    return sorted(types) if types else ["string"]


def _json_type_of(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, list):
        return "array"
    if isinstance(value, dict):
        return "object"
    return "string"


_TYPE_ALIASES = {
    "str": "string", "text": "string", "varchar": "string", "char": "string",
    "enum": "string", "int": "integer", "int32": "integer", "int64": "integer",
    "uint": "integer", "uint32": "integer", "uint64": "integer", "long": "integer",
    "short": "integer", "unsigned": "integer", "float": "number", "float32": "number",
    "float64": "number", "double": "number", "bool": "boolean", "dict": "object",
    "arr": "array", "list": "array", "sequence": "array",
}  # fmt: skip
_TYPE_PRIORITY = ("null", "integer", "number", "boolean", "object", "array", "string")


def _finite(value: Any) -> bool:
    try:
        json.dumps(value, allow_nan=False)
    except (ValueError, TypeError):
        return False
    return True


def coerce_to_schema_type(value: str, schema_types: str | list[str]) -> Any:
    """Best-effort conversion of a raw text value to one of the schema's types, tried
    in vLLM's order (null, integer, number, boolean, object, array, string); the text
    itself when none fits."""
    if isinstance(schema_types, str):
        schema_types = [schema_types]
    wanted = {_TYPE_ALIASES.get(t.strip().lower(), t.strip().lower()) for t in schema_types}
    for candidate in _TYPE_PRIORITY:
        if candidate not in wanted:
            continue
        if candidate == "null":
            if value.lower() == "null":
                return None
        elif candidate == "string":
            return value
        elif candidate == "integer":
            try:
                return int(value)
            except ValueError:
                continue
        elif candidate == "number":
            try:
                number = float(value)
            except ValueError:
                continue
            if math.isfinite(number):
                return number if number != int(number) else int(number)
        elif candidate == "boolean":
            lowered = value.lower().strip()
            if lowered in ("true", "1"):
                return True
            if lowered in ("false", "0"):
                return False
        else:
            try:
                parsed = json.loads(value)
            except ValueError:
                continue
            if _finite(parsed):
                return parsed
    try:
        parsed = json.loads(value)
    except ValueError:
        return value
    return parsed if _finite(parsed) else value


def coerce_value(value: Any, schema: dict) -> tuple[Any, bool]:
    """Coerce one argument value by its property schema: ``(value, changed)``."""
    if isinstance(value, str):
        coerced = coerce_to_schema_type(value, extract_types_from_schema(schema))
        return (coerced, True) if coerced is not value else (value, False)
    if isinstance(value, dict):
        nested = schema.get("properties")
        if isinstance(nested, dict):
            return value, coerce_dict(value, nested)
        return value, False
    if isinstance(value, list):
        items = schema.get("items")
        changed = False
        if isinstance(items, dict):
            for i, item in enumerate(value):
                coerced, item_changed = coerce_value(item, items)
                if item_changed:
                    value[i] = coerced
                    changed = True
        return value, changed
    as_text = json.dumps(value, ensure_ascii=False)
    coerced = coerce_to_schema_type(as_text, extract_types_from_schema(schema))
    if type(coerced) is not type(value) or coerced != value:
        return coerced, True
    return value, False


def coerce_dict(args: dict, properties: dict) -> bool:
    """Coerce ``args`` in place by ``properties``; whether anything changed."""
    changed = False
    for key, value in args.items():
        prop = properties.get(key)
        if isinstance(prop, dict):
            coerced, value_changed = coerce_value(value, prop)
            if value_changed:
                args[key] = coerced
                changed = True
    return changed


def fix_argument_types(args_json: str, name: str, tools: Sequence[Any]) -> str:
    """Re-type a call's JSON arguments by the tool's schema (vLLM's engine parsers do
    this for formats whose values arrive as text); unchanged without a schema."""
    if not tools or not name:
        return args_json
    try:
        args = json.loads(args_json)
    except ValueError:
        return args_json
    if not isinstance(args, dict):
        return args_json
    properties = find_tool_properties(tools, name)
    if not properties or not coerce_dict(args, properties):
        return args_json
    return json.dumps(args, ensure_ascii=False)


def streamable_string_keys(properties: dict) -> set[str] | None:
    """Keys whose unfinished string values can stream (``None``: no schema, all can)."""
    if not properties:
        return None
    return {
        key for key, schema in properties.items()
        if set(extract_types_from_schema(schema)) == {"string"}
    }  # fmt: skip
