"""``loramux gc``: collect unreferenced objects and cache entries."""

from __future__ import annotations

import argparse

from loramux.platform.cli.common import EXIT_OK, open_registry, registry_options


def add_gc_command(sub: argparse._SubParsersAction) -> None:
    gc = sub.add_parser("gc", parents=[registry_options()], help="collect unreferenced objects")
    gc.add_argument(
        "--min-age", type=float, default=3600.0, help="only objects older than this (seconds)"
    )
    gc.set_defaults(func=cmd_gc)


def cmd_gc(args: argparse.Namespace) -> int:
    report = open_registry(args).gc(min_age_seconds=args.min_age)
    print(
        f"deleted {len(report.deleted_objects)} objects, "
        f"pruned {len(report.pruned_cache_entries)} cache entries"
    )
    return EXIT_OK
