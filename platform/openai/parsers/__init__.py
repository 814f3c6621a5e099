"""Tool-call and reasoning parsers with vLLM 0.32's names, behaviour and start-up checks.

The seam: :class:`ToolParser` and :class:`ReasoningParser` (one instance per request,
built with the served tokenizer), found by name in :class:`ToolParserManager` and
:class:`ReasoningParserManager`; plain-data outputs in :mod:`.types`. Start-up:
:func:`load_parser_plugins`, then :func:`validate_parser_flags`, then
:func:`validate_parser_tokenizer` (all raise :class:`ParserStartupError`).
"""

from loramux.platform.openai.parsers.reasoning_parser import ReasoningParser
from loramux.platform.openai.parsers.registry import (
    ParserStartupError,
    ReasoningParserManager,
    ToolParserManager,
    import_plugin,
    load_parser_plugins,
    validate_parser_flags,
    validate_parser_tokenizer,
)
from loramux.platform.openai.parsers.tool_parser import ToolParser
from loramux.platform.openai.parsers.types import (
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    ExtractedToolCalls,
    FunctionCall,
    ToolCall,
    make_tool_call_id,
)

_PACKAGE = __name__

#: --tool-call-parser name -> (module, class), as vLLM 0.32 maps them
BUILTIN_TOOL_PARSERS = {
    "hermes": ("hermes", "HermesToolParser"),
    "qwen3_json": ("hermes", "HermesToolParser"),
    "llama3_json": ("llama3_json", "Llama3JsonToolParser"),
    "llama4_json": ("llama3_json", "Llama3JsonToolParser"),
    "pythonic": ("pythonic", "PythonicToolParser"),
    "mistral": ("mistral", "MistralToolParser"),
    "qwen3_xml": ("qwen3_xml", "Qwen3XmlToolParser"),
    "qwen3_coder": ("qwen3_xml", "Qwen3XmlToolParser"),
}

#: --reasoning-parser name -> (module, class)
BUILTIN_REASONING_PARSERS = {
    "deepseek_r1": ("deepseek_r1", "DeepSeekR1ReasoningParser"),
    "qwen3": ("qwen3_reasoning", "Qwen3ReasoningParser"),
    "olmo3": ("olmo3", "Olmo3ReasoningParser"),
}

for _name, (_module, _cls) in BUILTIN_TOOL_PARSERS.items():
    ToolParserManager.register_lazy_module(_name, f"{_PACKAGE}.{_module}", _cls)
for _name, (_module, _cls) in BUILTIN_REASONING_PARSERS.items():
    ReasoningParserManager.register_lazy_module(_name, f"{_PACKAGE}.{_module}", _cls)

__all__ = [
    "BUILTIN_REASONING_PARSERS",
    "BUILTIN_TOOL_PARSERS",
    "DeltaFunctionCall",
    "DeltaMessage",
    "DeltaToolCall",
    "ExtractedToolCalls",
    "FunctionCall",
    "ParserStartupError",
    "ReasoningParser",
    "ReasoningParserManager",
    "ToolCall",
    "ToolParser",
    "ToolParserManager",
    "import_plugin",
    "load_parser_plugins",
    "make_tool_call_id",
    "validate_parser_flags",
    "validate_parser_tokenizer",
]
