"""What the command groups share: registry and model options (generated from
:class:`~loramux.platform.settings.Settings`), opening the registry, the audit actor."""

from __future__ import annotations

import argparse
import getpass
from pathlib import Path

from loramux.platform.cli.flags import (
    MODEL_FIELDS,
    REGISTRY_FIELDS,
    add_settings_arguments,
    settings_from_args,
)

EXIT_OK, EXIT_ERROR, EXIT_USAGE = 0, 1, 2


def registry_options() -> argparse.ArgumentParser:
    """Options every registry command takes (added through ``parents=``)."""
    p = argparse.ArgumentParser(add_help=False)
    add_settings_arguments(p.add_argument_group("registry"), REGISTRY_FIELDS)
    return p


def model_options() -> argparse.ArgumentParser:
    """The base model and the adapter limits (``--base-model`` is ``--model``)."""
    p = argparse.ArgumentParser(add_help=False)
    g = p.add_argument_group("base model")
    add_settings_arguments(g, MODEL_FIELDS, aliases={"model": ["--base-model"]})
    return p


def resolve_base_model(model: str | None) -> Path:
    """The base model folder: the setting, else the engine's default model."""
    if model:
        return Path(model).expanduser()
    from loramux.engine.default_model import default_model_path

    return default_model_path()


def registry_from_args(args: argparse.Namespace, *, with_model: bool = False):
    """The registry the flags (and ``LORAMUX_*``) describe; ``with_model`` validates
    uploads against the base model under the serving limits."""
    from loramux.platform.builders import open_registry

    settings = settings_from_args(args)
    return open_registry(settings, resolve_base_model(settings.model) if with_model else None)


def actor() -> str:
    try:
        user = getpass.getuser()
    except Exception:  # no user name in this environment
        user = "unknown"
    return f"cli:{user}"
