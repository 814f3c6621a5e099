"""``loramux gc``: collect unreferenced objects and cache entries."""

from __future__ import annotations

import argparse

from loramux.platform.cli.common import EXIT_OK, registry_from_args, registry_options
from loramux.registry.gc import DEFAULT_GC_MIN_AGE_S, LEFTOVER_AGE_S


def add_gc_command(sub: argparse._SubParsersAction) -> None:
    gc = sub.add_parser("gc", parents=[registry_options()], help="collect unreferenced objects")
    gc.add_argument(
        "--min-age", type=float, default=DEFAULT_GC_MIN_AGE_S,
        help="unreferenced objects without a pending upload: only those older than this "
             "(seconds)")
    gc.add_argument(
        "--leftover-age", type=float, default=LEFTOVER_AGE_S,
        help="scratch folders, temporary pieces and pending-upload markers older than this "
             "(seconds) are crash leftovers")
    gc.set_defaults(func=cmd_gc)


def cmd_gc(args: argparse.Namespace) -> int:
    report = registry_from_args(args).gc(min_age_seconds=args.min_age,
                                    leftover_age_s=args.leftover_age)
    print(
        f"deleted {len(report.deleted_objects)} objects, "
        f"pruned {len(report.pruned_cache_entries)} cache entries, "
        f"removed {len(report.removed_leftovers)} crash leftovers"
    )
    return EXIT_OK
