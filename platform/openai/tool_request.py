"""A chat request's ``tools`` / ``tool_choice`` → :class:`ToolPlan`: how the answer is
constrained and parsed (vLLM 0.32's semantics, checked with its messages).

- ``tool_choice`` defaults to ``"auto"`` when the request has tools. ``"auto"`` needs a
  tool parser (``--enable-auto-tool-choice --tool-call-parser``, or the adapter's own):
  the parser turns the model's text into calls.
- ``"required"`` / a named function are constrained by the structured-output backend:
  parsers whose format has a structural tag (``structural_tag_model``) get a grammar in
  the model's own call format and parse the answer as ``"auto"``; the rest (no parser,
  ``pythonic``, plugins) use vLLM's generic JSON: a list of ``{"name", "parameters"}``
  (required) or the function's arguments object (named).
- Argument schemas are pinned for tools marked ``"strict": true``; ``--tool-strict-level
  function`` constrains the call format of every request with tools (``"auto"`` too, for
  structural-tag formats), ``parameter`` pins every tool's schema.
- ``"none"``: no parsing; tools are still rendered unless
  ``--exclude-tools-when-tool-choice-none``.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from typing import Any

from loramux.engine.structured_params import StructuredOutputsParams
from loramux.platform.errors import BadRequest
from loramux.platform.openai.parsers import ToolParser
from loramux.platform.openai.protocol import ChatCompletionRequest, ChatTool
from loramux.platform.openai.structural_tags import tool_call_structural_tag
from loramux.platform.openai.tool_config import ParsingConfig

_CORRECT_USAGE = 'Correct usage: `{"type": "function", "function": {"name": "my_function"}}`'
AUTO_NEEDS_PARSER = ('"auto" tool choice requires --enable-auto-tool-choice and '
                     "--tool-call-parser to be set")


@dataclass
class ToolPlan:
    """What the serving layer does with one request's tools."""

    choice: str = "none"
    """``none`` | ``auto`` | ``required`` | ``named``."""
    named: str | None = None
    tools: list[ChatTool] = field(default_factory=list)
    parallel: bool = True
    parser: type[ToolParser] | None = None
    """Parse the answer with this parser (``auto``, and required/named in its format)."""
    generic: bool = False
    """required / named answered in vLLM's generic JSON (parsed here, not by a parser)."""
    constraint: StructuredOutputsParams | None = None
    """The grammar the tool choice imposes (replaces the request's own constraint)."""
    parser_name: str | None = None
    """The tool parser's registered name (metrics labels)."""

    @property
    def parses(self) -> bool:
        """Whether the answer becomes ``tool_calls`` at all."""
        return self.parser is not None or self.generic

    def template_tools(self, config: ParsingConfig) -> list[dict[str, Any]] | None:
        """The tools as the chat template sees them (``tools=`` of apply_chat_template)."""
        if not self.tools or (self.choice == "none" and config.exclude_tools_when_tool_choice_none):
            return None
        return [t.model_dump(exclude_none=True) for t in self.tools]

    def request_view(self) -> dict[str, Any]:
        """What the parsers read as the request (its tools and choice)."""
        choice: Any = self.choice
        if self.choice == "named":
            choice = {"type": "function", "function": {"name": self.named}}
        return {"tools": self.tools, "tool_choice": choice}


def plan_tools(req: ChatCompletionRequest, config: ParsingConfig, max_tools: int) -> ToolPlan:
    """Check the request's tool fields (400 naming the field) and plan them."""
    tools = list(req.tools or [])
    if len(tools) > max_tools:
        raise BadRequest(f"tools has {len(tools)} tools, more than this server allows "
                         f"({max_tools}, max_tools)", param="tools")
    choice, named = _choice(req, tools)
    parallel = req.parallel_tool_calls is not False
    if choice == "required" and not tools:  # OpenAI: behaves as "none"
        choice = "none"
    if choice == "none" or not tools:
        return ToolPlan(choice, None, tools, parallel)
    parser = config.tool_parser_class()
    plan = _plan_choice(choice, named, tools, parallel, parser, config)
    plan.parser_name = config.tool_call_parser if plan.parser is not None else None
    return plan


def _plan_choice(choice: str, named: str | None, tools: list[ChatTool], parallel: bool,
                 parser: type[ToolParser] | None, config: ParsingConfig) -> ToolPlan:
    if choice == "auto":
        if not config.auto_tools or parser is None:
            raise BadRequest(AUTO_NEEDS_PARSER, param="tool_choice")
        plan = ToolPlan(choice, None, tools, parallel, parser=parser)
        if _constrains_auto(tools, config) and parser.structural_tag_model:
            plan.constraint = _tag(parser.structural_tag_model, plan, config)
        return plan
    if parser is None or parser.supports_required_and_named:
        return ToolPlan(choice, named, tools, parallel, generic=True,
                        constraint=StructuredOutputsParams(json=generic_schema(choice, named, tools,
                                                                              parallel)))
    plan = ToolPlan(choice, named, tools, parallel, parser=parser)
    if parser.structural_tag_model:
        plan.constraint = _tag(parser.structural_tag_model, plan, config)
    else:  # the format parses a bare JSON call list (mistral)
        only = [t for t in tools if named is None or t.function.name == named]
        plan.constraint = StructuredOutputsParams(
            json=generic_schema("required", None, only, parallel and named is None))
    return plan


def _choice(req: ChatCompletionRequest, tools: list[ChatTool]) -> tuple[str, str | None]:
    choice = req.tool_choice
    if choice is None:
        return ("auto" if tools else "none"), None
    if choice == "none":
        return "none", None
    if req.tools is None:
        raise BadRequest("When using `tool_choice`, `tools` must be set.", param="tool_choice")
    if isinstance(choice, str):
        if choice not in ("auto", "required"):
            raise BadRequest(f"Invalid value for `tool_choice`: {choice[:64]}! Only named tools, "
                             '"none", "auto" or "required" are supported.', param="tool_choice")
        return choice, None
    function = choice.get("function")
    if choice.get("type", "function") != "function" or not isinstance(function, dict):
        raise BadRequest(f"Invalid value for `function`: `{str(function)[:64]}` in `tool_choice`! "
                         f"{_CORRECT_USAGE}", param="tool_choice")
    name = function.get("name")
    if "name" not in function:
        raise BadRequest(f"Expected field `name` in `function` in `tool_choice`! {_CORRECT_USAGE}",
                         param="tool_choice")
    if not isinstance(name, str) or not name:
        raise BadRequest(f"Invalid `name` in `function`: `{str(name)[:64]}` in `tool_choice`! "
                         f"{_CORRECT_USAGE}", param="tool_choice")
    if all(t.function.name != name for t in tools):
        raise BadRequest("The tool specified in `tool_choice` does not match any of the "
                         "specified `tools`", param="tool_choice")
    return "named", name


def _constrains_auto(tools: list[ChatTool], config: ParsingConfig) -> bool:
    return config.tool_strict_level != "auto" or any(t.function.strict is True for t in tools)


def _tag(model: str, plan: ToolPlan, config: ParsingConfig) -> StructuredOutputsParams:
    try:
        tag = tool_call_structural_tag(model, plan.tools, plan.choice, plan.named, plan.parallel,
                                       config.tool_strict_level)
    except ValueError as e:
        raise BadRequest(f"tools cannot be constrained in the {model} format: {e}",
                         param="tools") from None
    return StructuredOutputsParams(structural_tag=tag)


def _parameters(tool: ChatTool) -> dict[str, Any]:
    return copy.deepcopy(tool.function.parameters) or {"type": "object", "properties": {}}


def generic_schema(choice: str, named: str | None, tools: list[ChatTool],
                   parallel: bool) -> dict[str, Any]:
    """vLLM's generic JSON schema: a named function's arguments object, or for
    ``required`` a non-empty list of ``{"name", "parameters"}`` (one item without
    parallel calls); the tools' ``$defs`` are hoisted to the top."""
    if choice == "named":
        return _parameters(next(t for t in tools if t.function.name == named))
    defs: dict[str, Any] = {}
    items = []
    for tool in tools:
        params = _parameters(tool)
        for name, schema in params.pop("$defs", {}).items():
            if name in defs and defs[name] != schema:
                raise BadRequest(f"Tool definition '{name}' has multiple schemas, which is not "
                                 "supported.", param="tools")
            defs[name] = schema
        items.append({"properties": {"name": {"type": "string", "enum": [tool.function.name]},
                                     "parameters": params},
                      "required": ["name", "parameters"]})
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": {"type": "object", "anyOf": items}}
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def parse_generic(text: str, plan: ToolPlan) -> list[tuple[str, str]]:
    """``[(name, arguments JSON)]`` of a generic-JSON answer (vLLM: a named function's
    arguments are the text as generated; required's are re-serialized). ``ValueError``
    when the text is not such JSON (the grammar was cut off by ``max_tokens``)."""
    if plan.choice == "named":
        return [(plan.named or "", text)]
    calls = json.loads(text)
    if not isinstance(calls, list):
        raise ValueError("not a list of calls")
    out = []
    for call in calls:
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            raise ValueError("a call without a name")
        out.append(generic_call(call))
    return out[:1] if not plan.parallel else out


def generic_call(item: dict[str, Any]) -> tuple[str, str]:
    """``(name, arguments JSON)`` of one ``{"name", "parameters"}`` item (re-serialized)."""
    return item["name"], json.dumps(item.get("parameters", {}), ensure_ascii=False)
