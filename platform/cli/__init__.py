"""The ``loramux`` command line: one module per command group.

    loramux db upgrade                                   migrate the registry database to head
    loramux tenants create NAME [--admin]                prints the new API key once
    loramux tenants list
    loramux adapters validate PATH                       check an adapter against the base model
    loramux adapters upload PATH --tenant T --name N     validate, store, register
    loramux adapters list --tenant T [--json]
    loramux adapters delete NAME --tenant T
    loramux export NAME --tenant T --out DIR [--check]   merge into the base model
    loramux gc                                           collect unreferenced objects
    loramux serve [MODEL] [--port N] ...                 the HTTP server
    loramux admin adapters                               residency (through the admin API)
    loramux admin evict|pin|unpin|warm NAME --tenant T   operator actions (admin API)

Every option is a :class:`~loramux.platform.settings.Settings` field: a flag left out
falls back to its ``LORAMUX_*`` variable, then to the default, so ``adapters upload``
checks an adapter against the same ``--max-lora-rank`` that ``serve`` serves.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from loramux.platform.cli.adapters import add_adapter_commands
from loramux.platform.cli.admin import add_admin_commands
from loramux.platform.cli.common import EXIT_ERROR
from loramux.platform.cli.db import add_db_commands
from loramux.platform.cli.export import add_export_command
from loramux.platform.cli.gc import add_gc_command
from loramux.platform.cli.serve import add_serve_command
from loramux.platform.cli.tenants import add_tenant_commands

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="loramux", description="Multi-tenant LoRA adapter serving."
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True)
    add_db_commands(sub)
    add_tenant_commands(sub)
    add_adapter_commands(sub)
    add_export_command(sub)
    add_gc_command(sub)
    add_serve_command(sub)
    add_admin_commands(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point (``loramux``); returns the exit status."""
    import logging

    from loramux.adapters.errors import AdapterValidationError
    from loramux.adapters.merge import MergeCheckError
    from loramux.platform.errors import APIError
    from loramux.registry.errors import RegistryError

    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    try:
        return args.func(args)
    except AdapterValidationError as e:
        print(f"error: adapter refused: {e}", file=sys.stderr)
        return EXIT_ERROR
    except APIError as e:  # a refusal shared with the HTTP API (e.g. a preset)
        print(f"error: {e.message}", file=sys.stderr)
        return EXIT_ERROR
    except (RegistryError, MergeCheckError, FileNotFoundError, FileExistsError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_ERROR
