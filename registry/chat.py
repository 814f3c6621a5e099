"""An adapter's chat settings as the registry keeps them: its own Jinja chat template and
the names of its tool-call and reasoning parsers (NULL: the server's, for each).

Which template an adapter folder ships follows transformers (``AutoTokenizer`` loading
the folder, then ``apply_chat_template(..., tools=[...])`` choosing):

1. template files: ``chat_template.jinja`` (the template named ``default``) and
   ``additional_chat_templates/<name>.jinja``; when any of them exists,
   ``tokenizer_config.json``'s ``chat_template`` is ignored (files take priority);
2. else ``tokenizer_config.json``'s ``chat_template``: one string, or a list of
   ``{"name": ..., "template": ...}`` objects (transformers' named templates).

One template is stored as is. Of named templates the registry stores the one transformers
picks for a request *with tools*: ``tool_use`` when there is one, else ``default``; a set
with neither is refused (transformers refuses to render it too). That one template then
serves every request to the adapter, with or without tools (``tools`` is None without).

Whether a template renders, and whether a parser name exists and works with the served
tokenizer, is the serving side's business (``loramux.platform.adapter_api.chat`` checks
both before calling the registry); the registry checks only what it stores: a template
of at most :data:`MAX_CHAT_TEMPLATE_CHARS`, parser names of the column's shape.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any

from loramux.registry.errors import InvalidChatSettings

TEMPLATE_FILE = "chat_template.jinja"
TEMPLATES_DIR = "additional_chat_templates"
TOKENIZER_CONFIG = "tokenizer_config.json"
CHAT_FILES = (TEMPLATE_FILE, TOKENIZER_CONFIG)
"""The files beside an adapter that carry its template (what a local upload copies)."""
MAX_CHAT_TEMPLATE_CHARS = 1 << 20
"""The registry's own bound on a stored template (the server's ``max_chat_template_chars``
is the tighter one its API applies)."""
MAX_TOKENIZER_CONFIG_BYTES = 16 << 20
PARSER_FIELDS = ("tool_call_parser", "reasoning_parser")
_PARSER_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def template_digest(template: str) -> str:
    """sha256 (hex) of a template's UTF-8 text: what listings show instead of the text."""
    return hashlib.sha256(template.encode("utf-8")).hexdigest()


def check_template(template: Any, param: str = "chat_template") -> str | None:
    """The template to store (None or ``""``: none, the server's), or
    :class:`InvalidChatSettings`."""
    if template is None or template == "":
        return None
    if not isinstance(template, str):
        raise InvalidChatSettings(param, f"{param} must be a string (Jinja source), got "
                                  f"{type(template).__name__}")
    if len(template) > MAX_CHAT_TEMPLATE_CHARS:
        raise InvalidChatSettings(param, f"{param} has {len(template)} characters, more than "
                                  f"the registry stores ({MAX_CHAT_TEMPLATE_CHARS})")
    return template


def check_parser_name(param: str, name: Any) -> str | None:
    """The parser name to store (None or ``""``: the server's), or
    :class:`InvalidChatSettings` naming ``param``."""
    if name is None or name == "":
        return None
    if not isinstance(name, str) or not _PARSER_RE.fullmatch(name):
        shown = name[:40] if isinstance(name, str) else type(name).__name__
        raise InvalidChatSettings(param, f"{param} {shown!r} is not a parser name (1-64 "
                                  "letters, digits, '.', '_' or '-')")
    return name


def _read_text(path: Path, max_bytes: int) -> str:
    size = path.stat().st_size
    if size > max_bytes:
        raise InvalidChatSettings("chat_template", f"{path.name} is {size} bytes, more than "
                                  f"{max_bytes}")
    try:
        return path.read_bytes().decode("utf-8")
    except UnicodeDecodeError:
        raise InvalidChatSettings("chat_template", f"{path.name} is not UTF-8 text") from None


def _template_files(folder: Path) -> dict[str, str]:
    """``{name: template}`` of the template files (transformers' names)."""
    found: dict[str, str] = {}
    max_bytes = 4 * MAX_CHAT_TEMPLATE_CHARS
    if (folder / TEMPLATE_FILE).is_file():
        found["default"] = _read_text(folder / TEMPLATE_FILE, max_bytes)
    extra = folder / TEMPLATES_DIR
    if extra.is_dir():
        for path in sorted(extra.glob("*.jinja")):
            if path.is_file():
                found[path.name.removesuffix(".jinja")] = _read_text(path, max_bytes)
    return found


def _config_templates(folder: Path) -> str | dict[str, str] | None:
    """``tokenizer_config.json``'s ``chat_template``: a string, named templates, or None."""
    path = folder / TOKENIZER_CONFIG
    if not path.is_file():
        return None
    try:
        config = json.loads(_read_text(path, MAX_TOKENIZER_CONFIG_BYTES))
    except ValueError as e:
        raise InvalidChatSettings("chat_template", f"{TOKENIZER_CONFIG} is not valid JSON: "
                                  f"{e}") from None
    value = config.get("chat_template") if isinstance(config, dict) else None
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list) and all(
            isinstance(t, dict) and isinstance(t.get("name"), str)
            and isinstance(t.get("template"), str) for t in value):
        return {t["name"]: t["template"] for t in value}
    raise InvalidChatSettings("chat_template", f"{TOKENIZER_CONFIG}: chat_template must be a "
                              'string or a list of {"name", "template"} objects')


def pick_template(templates: str | dict[str, str] | None) -> str | None:
    """The one template to store: a single one as is; of named ones what transformers'
    ``get_chat_template`` picks with tools (``tool_use``, else ``default``)."""
    if templates is None or isinstance(templates, str):
        return templates
    for name in ("tool_use", "default"):
        if name in templates:
            return templates[name]
    raise InvalidChatSettings(
        "chat_template", f"the adapter ships chat templates named {sorted(templates)[:8]} but "
        "none named 'default' or 'tool_use' (transformers cannot pick one either); ship "
        f"{TEMPLATE_FILE} or send chat_template")


def read_chat_template(folder: str | Path) -> str | None:
    """The chat template an adapter folder ships (see the module's rule), or None. Called
    on an upload's checked folder (no links) and on static adapters' folders."""
    folder = Path(folder)
    files = _template_files(folder)
    template = pick_template(files or _config_templates(folder))
    return check_template(template)


def check_chat(changes: dict[str, Any]) -> dict[str, str | None]:
    """The columns to store for a change of chat settings (keys ``chat_template``,
    ``tool_call_parser``, ``reasoning_parser``; None clears one)."""
    out: dict[str, str | None] = {}
    for key, value in changes.items():
        if key == "chat_template":
            out[key] = check_template(value)
        elif key in PARSER_FIELDS:
            out[key] = check_parser_name(key, value)
        else:
            raise TypeError(f"unknown chat setting {key!r}")
    return out


def audit_details(values: dict[str, str | None]) -> dict[str, Any]:
    """What the audit log keeps of a change: the parser names, the template's digest and
    length (never its text)."""
    details: dict[str, Any] = {k: v for k, v in values.items() if k != "chat_template"}
    if "chat_template" in values:
        template = values["chat_template"]
        details["chat_template"] = None if template is None else {
            "sha256": template_digest(template), "chars": len(template)}
    return details
