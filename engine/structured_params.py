"""A request's structured-output constraint (vLLM's ``StructuredOutputsParams``), checked
when it is built; compiling and enforcing it is ``structured_output.py``'s."""

from __future__ import annotations

import json
from dataclasses import dataclass


@dataclass
class StructuredOutputsParams:
    """Exactly one constraint: ``json`` (a JSON schema, dict or string), ``json_object``
    (any JSON object), ``regex``, ``choice`` (one of these strings) or ``grammar`` (EBNF)."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def __post_init__(self) -> None:
        given = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        if self.json_object:
            given.append("json_object")
        if len(given) != 1:
            raise ValueError(
                "structured_outputs needs exactly one of json, json_object, regex, choice, grammar; "
                f"got {given or 'none'}."
            )
        if self.choice is not None and (
            not isinstance(self.choice, list) or not self.choice or not all(isinstance(c, str) for c in self.choice)
        ):
            raise ValueError("structured_outputs.choice must be a non-empty list of strings.")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise ValueError(f"structured_outputs.{name} must be a string.")
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise ValueError("structured_outputs.json must be a JSON schema (object or string).")

    def cache_key(self) -> str:
        return json.dumps(
            {"json": self.json, "regex": self.regex, "choice": self.choice, "grammar": self.grammar,
             "json_object": bool(self.json_object)},
            sort_keys=True,
        )
