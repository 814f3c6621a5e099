"""A request's structured-output constraint (vLLM's ``StructuredOutputsParams``), checked
when it is built; compiling and enforcing it is ``structured_output.py``'s, and waiting for
the end of a thought (``reasoning_end``) is ``grammar_gate.py``'s."""

from __future__ import annotations

import json
from dataclasses import dataclass

_KINDS = ("json", "regex", "choice", "grammar", "structural_tag")


@dataclass
class StructuredOutputsParams:
    """Exactly one constraint: ``json`` (a JSON schema, dict or string), ``json_object``
    (any JSON object), ``regex``, ``choice`` (one of these strings), ``grammar`` (EBNF) or
    ``structural_tag`` (an xgrammar structural tag); and, for a reasoning model, when it
    starts to apply (``reasoning_end``)."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | dict | None = None
    """An xgrammar structural tag (``xgrammar.StructuralTag`` as JSON, vLLM's
    ``structured_outputs.structural_tag``): ``{"type": "structural_tag", "format": {...}}``,
    a dict or its JSON text. Its format is checked when it is compiled."""
    reasoning_end: list[list[int]] | None = None
    """Token-id sequences that close a thought (e.g. the ids of ``</think>``; several
    spellings allowed). When set, the grammar neither masks nor follows a row's tokens
    until the row's generated tokens contain one of them; it applies from its start to the
    token after that. None: it applies from the first generated token. Not part of
    :meth:`cache_key` (the gate is per row; the compiled grammar is shared)."""

    def __post_init__(self) -> None:
        given = [k for k in _KINDS if getattr(self, k) is not None]
        if self.json_object:
            given.append("json_object")
        if len(given) != 1:
            raise ValueError(
                "structured_outputs needs exactly one of json, json_object, regex, choice, grammar, "
                f"structural_tag; got {given or 'none'}."
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
        if self.structural_tag is not None:
            _check_structural_tag(self.structural_tag)
        if self.reasoning_end is not None:
            _check_reasoning_end(self.reasoning_end)

    def cache_key(self) -> str:
        """The compiled grammar's identity (and the constraint's serialized size, which the
        platform limits): requests with equal keys share one compiled grammar. Each row
        gets its own matcher and gate, so ``reasoning_end`` is not part of it."""
        return json.dumps(
            {"json": self.json, "regex": self.regex, "choice": self.choice, "grammar": self.grammar,
             "json_object": bool(self.json_object), "structural_tag": self.structural_tag},
            sort_keys=True,
        )


def _check_structural_tag(tag: object) -> None:
    """The shape every structural tag has (a JSON object with a ``format`` object); xgrammar
    checks the format itself when it compiles the tag."""
    name = "structured_outputs.structural_tag"
    if isinstance(tag, str):
        try:
            tag = json.loads(tag)
        except ValueError as e:
            raise ValueError(f"{name} is not valid JSON ({e}).") from None
    if not isinstance(tag, dict):
        raise ValueError(f'{name} must be a JSON object {{"type": "structural_tag", "format": {{...}}}}.')
    if tag.get("type", "structural_tag") != "structural_tag":
        raise ValueError(f'{name}.type must be "structural_tag", got {tag.get("type")!r}.')
    if not isinstance(tag.get("format"), dict):
        raise ValueError(f"{name} needs a format object (xgrammar's structural tag formats).")


def _check_reasoning_end(ends: object) -> None:
    if not (isinstance(ends, list) and ends and all(
            isinstance(seq, list) and seq and all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in seq)
            for seq in ends)):
        raise ValueError("structured_outputs.reasoning_end must be a non-empty list of non-empty "
                         "lists of token ids.")
