"""``loramux export``: an adapter merged into the base model."""

from __future__ import annotations

import argparse

from loramux.platform.cli.common import (
    EXIT_OK,
    actor,
    model_options,
    registry_from_args,
    registry_options,
)


def add_export_command(sub: argparse._SubParsersAction) -> None:
    export = sub.add_parser(
        "export",
        parents=[registry_options(), model_options()],
        help="merge an adapter into the base model (Hugging Face folder)",
    )
    export.add_argument("name")
    export.add_argument("--tenant", required=True)
    export.add_argument("--out", required=True, help="output folder")
    export.add_argument("--check", action="store_true", help="compare logits with base+adapter")
    export.add_argument("--overwrite", action="store_true")
    export.set_defaults(func=cmd_export)


def cmd_export(args: argparse.Namespace) -> int:
    registry = registry_from_args(args, with_model=True)
    out = registry.export(
        args.tenant, args.name, args.out, check=args.check, actor=actor(), overwrite=args.overwrite
    )
    print(f"exported {args.name!r} merged into {registry.base_model_name} at {out}")
    return EXIT_OK
