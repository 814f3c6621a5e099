"""``loramux db``: the registry database schema (Alembic)."""

from __future__ import annotations

import argparse

from loramux.platform.cli.common import EXIT_OK, registry_options
from loramux.platform.cli.flags import settings_from_args


def add_db_commands(sub: argparse._SubParsersAction) -> None:
    db = sub.add_parser("db", help="registry database schema")
    dbsub = db.add_subparsers(dest="db_command", required=True)
    up = dbsub.add_parser("upgrade", parents=[registry_options()], help="migrate to a revision")
    up.add_argument("revision", nargs="?", default="head")
    up.set_defaults(func=cmd_db_upgrade)
    down = dbsub.add_parser("downgrade", parents=[registry_options()], help="revert to a revision")
    down.add_argument("revision")
    down.set_defaults(func=cmd_db_downgrade)
    cur = dbsub.add_parser("current", parents=[registry_options()], help="show the revision")
    cur.set_defaults(func=cmd_db_current)


def _database(args: argparse.Namespace):
    from loramux.registry.db import Database
    from loramux.registry.factory import default_data_dir, default_database_url

    settings = settings_from_args(args)
    data_dir = settings.data_dir.expanduser() if settings.data_dir else default_data_dir()
    return Database(settings.database_url or default_database_url(data_dir))


def cmd_db_upgrade(args: argparse.Namespace) -> int:
    db = _database(args)
    db.upgrade(args.revision)
    print(f"database at revision {db.current_revision()}")
    return EXIT_OK


def cmd_db_downgrade(args: argparse.Namespace) -> int:
    db = _database(args)
    db.downgrade(args.revision)
    print(f"database at revision {db.current_revision() or 'base (empty)'}")
    return EXIT_OK


def cmd_db_current(args: argparse.Namespace) -> int:
    db = _database(args)
    print(f"current {db.current_revision() or 'none'}, head {db.head_revision()}")
    return EXIT_OK
