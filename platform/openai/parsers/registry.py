"""Parsers by name: vLLM's ``ToolParserManager`` / ``ReasoningParserManager`` and the
start-up checks of ``--tool-call-parser``, ``--reasoning-parser`` and the plugin flags.

Built-in parsers are registered lazily (name -> module, class) by the package's
``__init__``; a plugin file registers its own with the decorator::

    from loramux.platform.openai.parsers import ToolParser, ToolParserManager

    @ToolParserManager.register_module("my_format")
    class MyToolParser(ToolParser): ...

and is loaded at start-up with ``--tool-parser-plugin /path/to/file.py``
(:meth:`ToolParserManager.import_tool_parser`).
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any, ClassVar

from loramux.platform.openai.parsers.reasoning_parser import ReasoningParser
from loramux.platform.openai.parsers.tool_parser import ToolParser

logger = logging.getLogger(__name__)


class ParserStartupError(Exception):
    """A parser flag that the server must refuse at start-up (message names the flag)."""


def import_plugin(plugin_path: str) -> ModuleType | None:
    """Import a plugin: an importable module name, else a Python file path.

    As vLLM does, a plugin that fails to load is logged, not raised: the name it
    would have registered is then missing and the flag check refuses it.
    """
    try:
        return importlib.import_module(plugin_path)
    except ModuleNotFoundError:
        pass
    module_name = os.path.splitext(os.path.basename(plugin_path))[0]
    try:
        spec = importlib.util.spec_from_file_location(module_name, plugin_path)
        if spec is None or spec.loader is None:
            raise ModuleNotFoundError(f"No module named {module_name!r}")
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        spec.loader.exec_module(module)
        return module
    except Exception:
        sys.modules.pop(module_name, None)
        logger.exception("Failed to load module '%s' from %s.", module_name, plugin_path)
        return None


class _ParserRegistry:
    """Shared registry logic; each subclass has its own tables and base class."""

    _base: ClassVar[type]
    _kind: ClassVar[str]
    _parsers: ClassVar[dict[str, type]]
    _lazy: ClassVar[dict[str, tuple[str, str]]]

    @classmethod
    def _get(cls, name: str) -> type:
        if name in cls._parsers:
            return cls._parsers[name]
        if name in cls._lazy:
            module_path, class_name = cls._lazy[name]
            parser_cls = getattr(importlib.import_module(module_path), class_name)
            if not (isinstance(parser_cls, type) and issubclass(parser_cls, cls._base)):
                raise TypeError(f"{class_name} in {module_path} is not a {cls._base.__name__}")
            cls._parsers[name] = parser_cls
            return parser_cls
        raise KeyError(
            f"{cls._kind} parser '{name}' not found. "
            f"Available parsers: {', '.join(cls.list_registered())}"
        )

    @classmethod
    def list_registered(cls) -> list[str]:
        """Every registered name, eager and lazy, sorted."""
        return sorted(set(cls._parsers) | set(cls._lazy))

    @classmethod
    def register_lazy_module(cls, name: str, module_path: str, class_name: str) -> None:
        """Map ``name`` to a class imported on first use."""
        cls._lazy[name] = (module_path, class_name)

    @classmethod
    def register_module(
        cls,
        name: str | list[str] | None = None,
        force: bool = True,
        module: type | None = None,
    ) -> Any:
        """Register a parser class under ``name`` (a list of names, or the class name).

        With ``module`` it registers at once; without, it is a class decorator.
        ``force=False`` refuses a name already taken.
        """
        if not isinstance(force, bool):
            raise TypeError(f"force must be a boolean, but got {type(force)}")

        def _register(obj: type) -> type:
            if not (isinstance(obj, type) and issubclass(obj, cls._base)):
                raise TypeError(
                    f"module must be subclass of {cls._base.__name__}, but got {type(obj)}"
                )
            if name is None:
                names = [obj.__name__]
            elif isinstance(name, str):
                names = [name]
            elif isinstance(name, list) and all(isinstance(n, str) for n in name):
                names = name
            else:
                raise TypeError("module_name must be str, list[str], or None.")
            for n in names:
                if not force and (n in cls._parsers or n in cls._lazy):
                    raise KeyError(f"{n} is already registered")
                cls._parsers[n] = obj
                cls._lazy.pop(n, None)
            return obj

        if module is not None:
            return _register(module)
        return _register


class ToolParserManager(_ParserRegistry):
    """Tool-call parsers by ``--tool-call-parser`` name."""

    _base = ToolParser
    _kind = "Tool"
    _parsers: ClassVar[dict[str, type]] = {}
    _lazy: ClassVar[dict[str, tuple[str, str]]] = {}

    @classmethod
    def get_tool_parser(cls, name: str) -> type[ToolParser]:
        """The class registered as ``name``; ``KeyError`` naming the choices if none."""
        return cls._get(name)

    @classmethod
    def import_tool_parser(cls, plugin_path: str) -> None:
        """Load a ``--tool-parser-plugin`` (module name or file path)."""
        import_plugin(plugin_path)


class ReasoningParserManager(_ParserRegistry):
    """Reasoning parsers by ``--reasoning-parser`` name."""

    _base = ReasoningParser
    _kind = "Reasoning"
    _parsers: ClassVar[dict[str, type]] = {}
    _lazy: ClassVar[dict[str, tuple[str, str]]] = {}

    @classmethod
    def get_reasoning_parser(cls, name: str) -> type[ReasoningParser]:
        """The class registered as ``name``; ``KeyError`` naming the choices if none."""
        return cls._get(name)

    @classmethod
    def import_reasoning_parser(cls, plugin_path: str) -> None:
        """Load a ``--reasoning-parser-plugin`` (module name or file path)."""
        import_plugin(plugin_path)


def load_parser_plugins(tool_parser_plugin: str = "", reasoning_parser_plugin: str = "") -> None:
    """Import the plugin flags' files, as vLLM's server start does (a value of three
    characters or fewer is ignored there, and here)."""
    if tool_parser_plugin and len(tool_parser_plugin) > 3:
        ToolParserManager.import_tool_parser(tool_parser_plugin)
    if reasoning_parser_plugin and len(reasoning_parser_plugin) > 3:
        ReasoningParserManager.import_reasoning_parser(reasoning_parser_plugin)


def validate_parser_flags(
    enable_auto_tool_choice: bool,
    tool_call_parser: str | None,
    reasoning_parser: str | None,
) -> None:
    """vLLM's start-up refusals of the flags themselves (after plugins are loaded)."""
    if enable_auto_tool_choice and not tool_call_parser:
        raise ParserStartupError("Error: --enable-auto-tool-choice requires --tool-call-parser")
    tool_names = ToolParserManager.list_registered()
    if enable_auto_tool_choice and tool_call_parser not in tool_names:
        raise ParserStartupError(
            f"invalid tool call parser: {tool_call_parser} (chose from {{ {','.join(tool_names)} }})"
        )
    reasoning_names = ReasoningParserManager.list_registered()
    if reasoning_parser and reasoning_parser not in reasoning_names:
        raise ParserStartupError(
            f"invalid reasoning parser: {reasoning_parser} "
            f"(chose from {{ {','.join(reasoning_names)} }})"
        )


def validate_parser_tokenizer(
    tokenizer: Any,
    tool_call_parser: str | None = None,
    reasoning_parser: str | None = None,
    model_name: str | None = None,
) -> None:
    """Construct the named parsers once against the served tokenizer, refusing the
    server's start when one cannot work with it (e.g. ``llama3_json`` without
    ``<|python_tag|>`` in the vocabulary), with vLLM's message."""
    checks: list[tuple[str, Callable[[], object]]] = []
    if tool_call_parser:
        tool_cls = ToolParserManager.get_tool_parser(tool_call_parser)
        checks.append((f"--tool-call-parser {tool_call_parser}", lambda: tool_cls(tokenizer)))
    if reasoning_parser:
        reasoning_cls = ReasoningParserManager.get_reasoning_parser(reasoning_parser)
        checks.append((f"--reasoning-parser {reasoning_parser}", lambda: reasoning_cls(tokenizer)))
    failures = []
    for flag, construct in checks:
        try:
            construct()
        except Exception as exc:
            failures.append((flag, exc))
    if failures:
        flags = " and ".join(flag for flag, _ in failures)
        raise ParserStartupError(
            f"{flags} cannot be used with the tokenizer of {model_name!r}: {failures[0][1]}"
        ) from failures[0][1]
