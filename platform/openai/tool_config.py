"""The server's tool-calling and reasoning configuration (vLLM's flags), checked at start.

:func:`build_parsing_config` is called once while the app's state is built: it loads the
parser plugins, refuses bad flags with vLLM's messages and constructs each named parser
once against the served tokenizer (a parser that cannot work with it stops the server,
as in vLLM). The result, :class:`ParsingConfig`, is what every chat request reads; an
adapter's own parsers (its registry settings) override the server's per request
(:meth:`ParsingConfig.for_model`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any, Literal

from loramux.platform.openai.parsers import (
    ReasoningParser,
    ReasoningParserManager,
    ToolParser,
    ToolParserManager,
    load_parser_plugins,
    validate_parser_flags,
    validate_parser_tokenizer,
)
from loramux.platform.openai.parsers.registry import ParserStartupError

StrictLevel = Literal["auto", "function", "parameter"]
STRICT_LEVELS: tuple[StrictLevel, ...] = ("auto", "function", "parameter")
_BACKENDS = ("auto", "xgrammar")
_CONFIG_KEYS = ("backend", "enable_in_reasoning", "reasoning_parser")


def parse_structured_outputs_config(text: str | None) -> dict[str, Any]:
    """``--structured-outputs-config`` (JSON) as a dict; ``ValueError`` naming the key that
    this server does not act on (never accepted and ignored)."""
    if not text:
        return {}
    try:
        value = json.loads(text)
    except ValueError as e:
        raise ValueError(f"structured_outputs_config is not JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError("structured_outputs_config must be a JSON object")
    unknown = sorted(set(value) - set(_CONFIG_KEYS))
    if unknown:
        raise ValueError(f"structured_outputs_config: {', '.join(unknown)} not supported here "
                         f"(keys: {', '.join(_CONFIG_KEYS)})")
    if value.get("backend", "auto") not in _BACKENDS:
        raise ValueError(f"structured_outputs_config.backend must be one of {', '.join(_BACKENDS)} "
                         f"(grammars run on xgrammar), got {value['backend']!r}")
    if not isinstance(value.get("enable_in_reasoning", False), bool):
        raise ValueError("structured_outputs_config.enable_in_reasoning must be true or false")
    parser = value.get("reasoning_parser")
    if parser is not None and not isinstance(parser, str):
        raise ValueError("structured_outputs_config.reasoning_parser must be a string")
    return value


@dataclass(frozen=True)
class ParsingConfig:
    """How one model's chat requests are parsed (the server's, or an adapter's)."""

    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    """Registered name; None: tool_choice "auto" is refused, required/named use JSON."""
    reasoning_parser: str | None = None
    tool_strict_level: StrictLevel = "auto"
    enable_in_reasoning: bool = False
    """The structured-output grammar constrains the thought too (vLLM's default: not)."""
    exclude_tools_when_tool_choice_none: bool = False

    @property
    def auto_tools(self) -> bool:
        """Whether tool_choice "auto" is served (a parser is set and auto choice enabled)."""
        return self.enable_auto_tool_choice and self.tool_call_parser is not None

    def for_model(self, tool_call_parser: str | None, reasoning_parser: str | None) -> ParsingConfig:
        """This config with an adapter's own parsers: a named tool parser turns auto tool
        choice on for that adapter (its tenant chose it)."""
        config = self
        if tool_call_parser:
            config = replace(config, tool_call_parser=tool_call_parser, enable_auto_tool_choice=True)
        if reasoning_parser:
            config = replace(config, reasoning_parser=reasoning_parser)
        return config

    def tool_parser_class(self) -> type[ToolParser] | None:
        return ToolParserManager.get_tool_parser(self.tool_call_parser) if self.tool_call_parser else None

    def reasoning_parser_class(self) -> type[ReasoningParser] | None:
        if not self.reasoning_parser:
            return None
        return ReasoningParserManager.get_reasoning_parser(self.reasoning_parser)


def check_parser_flags(settings: Any) -> None:
    """Load the plugins and refuse bad parser flags (before the model loads)."""
    load_parser_plugins(settings.tool_parser_plugin, settings.reasoning_parser_plugin)
    validate_parser_flags(settings.enable_auto_tool_choice, settings.tool_call_parser,
                          _reasoning_parser(settings))
    if settings.tool_strict_level not in STRICT_LEVELS:
        raise ParserStartupError(f"tool_strict_level must be one of {', '.join(STRICT_LEVELS)}")


def _reasoning_parser(settings: Any) -> str | None:
    from_config = parse_structured_outputs_config(settings.structured_outputs_config)
    return settings.reasoning_parser or from_config.get("reasoning_parser") or None


def build_parsing_config(settings: Any, tokenizer: Any, model_name: str | None) -> ParsingConfig:
    """The server's :class:`ParsingConfig`; raises :class:`ParserStartupError` (the server
    does not start) for bad flags or parsers that cannot work with ``tokenizer``."""
    check_parser_flags(settings)
    reasoning = _reasoning_parser(settings)
    tool_parser = settings.tool_call_parser or None
    if tool_parser is not None and tool_parser not in ToolParserManager.list_registered():
        raise ParserStartupError(
            f"invalid tool call parser: {tool_parser} "
            f"(chose from {{ {','.join(ToolParserManager.list_registered())} }})")
    validate_parser_tokenizer(tokenizer, tool_parser, reasoning, model_name)
    extra = parse_structured_outputs_config(settings.structured_outputs_config)
    return ParsingConfig(
        enable_auto_tool_choice=bool(settings.enable_auto_tool_choice),
        tool_call_parser=tool_parser,
        reasoning_parser=reasoning,
        tool_strict_level=settings.tool_strict_level,
        enable_in_reasoning=bool(extra.get("enable_in_reasoning", False)),
        exclude_tools_when_tool_choice_none=bool(settings.exclude_tools_when_tool_choice_none),
    )
