"""``--flags`` generated from :class:`~loramux.platform.settings.Settings`: one per field,
its description as help, grouped; and the settings a parsed command line describes."""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from typing import Annotated, Any

from pydantic import SecretStr

from loramux.platform.settings import QUOTA_PREFIX, Settings
from loramux.registry.budgets import DependencyBudgets

GROUPS = {"max_stop": "request limits", QUOTA_PREFIX + "max_concurrent_requests": "tenant quotas",
          "s3_connect_timeout": "dependencies (timeouts, bulkheads, breakers)",
          "model": "engine (vLLM names)", "host": "HTTP",
          "enable_auto_tool_choice": "tool calling and reasoning (vLLM names)", "database_url": "registry",
          "role": "cluster (see loramux.platform.cluster)",
          "protocol_metrics_port": "behind an inference gateway (see loramux.platform.inference_gateway)",
          "quota_cache_ttl": "isolation"}
"""The flag group that starts at each of these fields (in declaration order)."""
REGISTRY_FIELDS = ("data_dir", "database_url", "s3_bucket", "s3_endpoint_url", "s3_prefix",
                   "s3_region", *(f.name for f in dataclasses.fields(DependencyBudgets)))
MODEL_FIELDS = ("model", "max_lora_rank", "max_adapter_bytes")



def _flag_type(annotation: Any) -> tuple[Any, bool]:
    """(argparse type, is a list) of a field's annotation."""
    if typing.get_origin(annotation) is Annotated:
        annotation = typing.get_args(annotation)[0]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        annotation = next(a for a in typing.get_args(annotation) if a is not type(None))
    if typing.get_origin(annotation) is list:
        return str, True
    if annotation in (int, float):
        return annotation, False
    return str, False


def add_settings_arguments(parser: Any, names: typing.Iterable[str] | None = None, *,
                           aliases: dict[str, list[str]] | None = None) -> None:
    """One ``--flag`` per :class:`Settings` field (all, or ``names``), with the field's
    description as help; a flag left out stays None, so the variable or default applies."""
    wanted = set(names) if names is not None else None
    group: Any = parser
    for name, info in Settings.model_fields.items():
        if name in GROUPS and wanted is None:
            group = parser.add_argument_group(GROUPS[name])
        if wanted is not None and name not in wanted:
            continue
        default = info.get_default(call_default_factory=True)
        shown = default.get_secret_value() if isinstance(default, SecretStr) else default
        help_text = (info.description or "").replace("%", "%%")
        help_text += f" [env LORAMUX_{name.upper()}; default {shown!r}]"
        flags = ["--" + name.replace("_", "-"), *(aliases or {}).get(name, ())]
        if info.annotation is bool:
            group.add_argument(*flags, dest=name, action=argparse.BooleanOptionalAction, default=None,
                               help=help_text)
            continue
        kind, many = _flag_type(info.annotation)
        group.add_argument(*flags, dest=name, type=kind, nargs="+" if many else None, default=None,
                           help=help_text)


def settings_from_args(args: argparse.Namespace, **extra: Any) -> Settings:
    """Settings from the flags given (the rest from ``LORAMUX_*`` and the defaults)."""
    values = {k: v for k, v in vars(args).items() if k in Settings.model_fields and v is not None}
    values.update({k: v for k, v in extra.items() if v is not None})
    return Settings(**values)
