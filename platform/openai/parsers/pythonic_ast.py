"""Python-literal tool calls (``[f(a=1, b='x'), g()]``) read with :mod:`ast`, and the
completion of an unfinished one that the streaming ``pythonic`` parser needs."""

from __future__ import annotations

import ast
import json
from typing import Any

from loramux.platform.openai.parsers.types import FunctionCall, ToolCall

_JSON_NAMES = {"null": None, "true": True, "false": False}


class UnexpectedAstError(ValueError):
    """The text parses as Python but is not a list of calls with literal arguments."""


def parameter_value(node: ast.expr) -> Any:
    """The JSON value of a literal argument (``null``/``true``/``false`` accepted;
    tuples and sets become lists)."""
    if isinstance(node, ast.Constant):
        if node.value is None or isinstance(node.value, (str, int, float)):
            return node.value
        raise UnexpectedAstError("Tool call arguments must be JSON values")
    if isinstance(node, ast.Dict):
        if not all(isinstance(k, ast.Constant) for k in node.keys):
            raise UnexpectedAstError("Dict tool call arguments must have literal keys")
        return {k.value: parameter_value(v) for k, v in zip(node.keys, node.values, strict=True)}  # type: ignore[union-attr]
    if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
        return [parameter_value(v) for v in node.elts]
    if isinstance(node, ast.JoinedStr) and all(isinstance(p, ast.Constant) for p in node.values):
        return "".join(str(p.value) for p in node.values)  # type: ignore[attr-defined]
    if isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        operand = parameter_value(node.operand)
        if isinstance(operand, (int, float)) and not isinstance(operand, bool):
            return -operand if isinstance(node.op, ast.USub) else operand
    raise UnexpectedAstError("Tool call arguments must be literals")


def _dotted_name(node: ast.expr) -> str:
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        raise UnexpectedAstError("Invalid tool call name")
    parts.append(node.id)
    return ".".join(reversed(parts))


def call_to_tool_call(call: ast.Call) -> ToolCall:
    """One ``f(a=1)`` node as a :class:`ToolCall` (dotted names kept: ``a.b.c``)."""
    if not isinstance(call.func, (ast.Name, ast.Attribute)):
        raise UnexpectedAstError("Invalid tool call name")
    arguments = {kw.arg: parameter_value(kw.value) for kw in call.keywords}
    return ToolCall(
        function=FunctionCall(
            name=_dotted_name(call.func), arguments=json.dumps(arguments, ensure_ascii=False)
        )
    )


def parse_call_list(text: str) -> list[ToolCall]:
    """The calls of a ``[f(...), g(...)]`` text; :class:`UnexpectedAstError` (or a
    ``SyntaxError``) when it is anything else."""
    module = ast.parse(text)
    parsed = getattr(module.body[0], "value", None) if module.body else None
    if not isinstance(parsed, ast.List) or not all(isinstance(e, ast.Call) for e in parsed.elts):
        raise UnexpectedAstError("Tool output must be a list of function calls")
    return [call_to_tool_call(e) for e in parsed.elts]  # type: ignore[arg-type]


def _is_escaped(text: str, index: int) -> bool:
    backslashes = 0
    j = index - 1
    while j >= 0 and text[j] == "\\":
        backslashes += 1
        j -= 1
    return backslashes % 2 == 1


_CLOSING = {"[": "]", "(": ")", "{": "}", "'": "'", '"': '"'}


def make_valid_python(text: str) -> tuple[str, str] | None:
    """Close the open brackets and quotes of an unfinished call list.

    ``(completed_text, added_suffix)``, or ``None`` when the text stops where no
    value can be read yet (after ``=``, inside a parameter name, mid-key).
    Raises :class:`UnexpectedAstError` on mismatched brackets.
    """
    stack: list[str] = []
    for index, char in enumerate(text):
        if stack and stack[-1] in ("'", '"'):
            if char == stack[-1] and not _is_escaped(text, index):
                stack.pop()
            continue
        if char in "[({":
            stack.append(char)
        elif char in "])}":
            opener = {"]": "[", ")": "(", "}": "{"}[char]
            if not stack or stack.pop() != opener:
                raise UnexpectedAstError(f"Mismatched {char!r}")
        elif char in ("'", '"'):
            stack.append(char)

    text = text.rstrip()
    if text.endswith(("=", ":")):
        return None
    if stack and stack[-1] == "{":
        before = text[: text.rfind("{")]
        if before.count(":") <= before.count(","):
            return None
    if stack and stack[-1] == "(":
        before = text[: text.rfind("(")]
        if before.count("=") <= before.count(","):
            return None
    if text.endswith(","):
        text = text[:-1]
    if stack and stack[-1] == "[" and not text.endswith(("[", ")")):
        return None
    added = "".join(_CLOSING[c] for c in reversed(stack))
    candidate = text + added
    try:
        module = ast.parse(candidate)
    except SyntaxError:
        return None
    if not module.body:
        return None
    if "}" in added and any(isinstance(node, ast.Set) for node in ast.walk(module)):
        return None  # a truncated dict read as a set
    return candidate, added
