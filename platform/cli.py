"""The ``loramux`` command line.

    loramux db upgrade                                   migrate the registry database to head
    loramux tenants create NAME [--admin]                prints the new API key once
    loramux tenants list
    loramux adapters validate PATH                       check an adapter against the base model
    loramux adapters upload PATH --tenant T --name N     validate, store, register
    loramux adapters list --tenant T [--json]
    loramux adapters delete NAME --tenant T
    loramux export NAME --tenant T --out DIR [--check]   merge into the base model
    loramux gc                                           collect unreferenced objects
    loramux serve [MODEL] [--port N] ...                 the HTTP server (see loramux.platform.serve)

Registry options (``--data-dir``, ``--database-url``, ``--s3-*``) default to the
``LORAMUX_*`` environment variables, then to the embedded layout in the data dir.
``--base-model`` (default ``LORAMUX_MODEL``, then the default SmolLM2-135M-Instruct) is
the model adapters are validated against and merged into.

Each command group is added by one ``add_*_commands(subparsers)`` function and each
command runs one ``cmd_*`` function returning the exit status.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

EXIT_OK, EXIT_ERROR, EXIT_USAGE = 0, 1, 2


# -- shared options ---------------------------------------------------------------------


def registry_options() -> argparse.ArgumentParser:
    """Options every registry command takes (added through ``parents=``)."""
    p = argparse.ArgumentParser(add_help=False)
    g = p.add_argument_group("registry")
    env = os.environ.get
    g.add_argument(
        "--data-dir", default=env("LORAMUX_DATA_DIR"), help="data dir (LORAMUX_DATA_DIR)"
    )
    g.add_argument(
        "--database-url",
        default=env("LORAMUX_DATABASE_URL"),
        help="SQLAlchemy URL (LORAMUX_DATABASE_URL; default: SQLite in the data dir)",
    )
    g.add_argument("--s3-bucket", default=env("LORAMUX_S3_BUCKET"), help="LORAMUX_S3_BUCKET")
    g.add_argument(
        "--s3-endpoint-url", default=env("LORAMUX_S3_ENDPOINT_URL"), help="MinIO / R2 / Ceph"
    )
    g.add_argument("--s3-prefix", default=env("LORAMUX_S3_PREFIX", ""))
    g.add_argument("--s3-region", default=env("LORAMUX_S3_REGION"))
    return p


def model_options() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument(
        "--base-model",
        default=os.environ.get("LORAMUX_MODEL"),
        help="base model folder (LORAMUX_MODEL; default: SmolLM2-135M-Instruct)",
    )
    p.add_argument("--max-lora-rank", type=int, default=None, help="default 64")
    p.add_argument("--max-adapter-bytes", type=int, default=None, help="default 1 GiB")
    return p


def resolve_base_model(arg: str | None) -> Path:
    """The base model folder: the argument, else the engine's default model."""
    if arg:
        return Path(arg).expanduser()
    from loramux.engine.default_model import default_model_path

    return default_model_path()


def open_registry(args: argparse.Namespace, *, with_model: bool = False, auto_upgrade=None):
    from loramux.adapters.format import DEFAULT_MAX_ADAPTER_BYTES, DEFAULT_MAX_LORA_RANK
    from loramux.registry import build_registry

    kwargs: dict[str, Any] = {}
    if with_model:
        kwargs["base_model"] = resolve_base_model(args.base_model)
        kwargs["max_lora_rank"] = args.max_lora_rank or DEFAULT_MAX_LORA_RANK
        kwargs["max_adapter_bytes"] = args.max_adapter_bytes or DEFAULT_MAX_ADAPTER_BYTES
    return build_registry(
        database_url=args.database_url,
        s3_bucket=args.s3_bucket,
        s3_endpoint_url=args.s3_endpoint_url,
        s3_prefix=args.s3_prefix,
        data_dir=args.data_dir,
        s3_region=args.s3_region,
        auto_upgrade=auto_upgrade,
        **kwargs,
    )


def actor() -> str:
    return f"cli:{os.environ.get('USER') or os.environ.get('USERNAME') or 'unknown'}"


# -- db -----------------------------------------------------------------------------------


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

    data_dir = Path(args.data_dir).expanduser() if args.data_dir else default_data_dir()
    return Database(args.database_url or default_database_url(data_dir))


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


# -- tenants ------------------------------------------------------------------------------


def add_tenant_commands(sub: argparse._SubParsersAction) -> None:
    tenants = sub.add_parser("tenants", help="tenants and API keys")
    tsub = tenants.add_subparsers(dest="tenants_command", required=True)
    create = tsub.add_parser("create", parents=[registry_options()], help="create a tenant")
    create.add_argument("name")
    create.add_argument("--admin", action="store_true", help="its key may use the admin API")
    create.set_defaults(func=cmd_tenants_create)
    lst = tsub.add_parser("list", parents=[registry_options()], help="list tenants")
    lst.set_defaults(func=cmd_tenants_list)
    key = tsub.add_parser("add-key", parents=[registry_options()], help="new API key for a tenant")
    key.add_argument("name")
    key.add_argument("--admin", action="store_true")
    key.add_argument("--label")
    key.set_defaults(func=cmd_tenants_add_key)
    revoke = tsub.add_parser("revoke-key", parents=[registry_options()], help="revoke an API key")
    revoke.add_argument("key", help="the key or its 12-character prefix")
    revoke.set_defaults(func=cmd_tenants_revoke_key)


def cmd_tenants_create(args: argparse.Namespace) -> int:
    registry = open_registry(args)
    tenant, key = registry.create_tenant(args.name, admin=args.admin)
    print(f"created tenant {tenant.name!r} (id {tenant.id})", file=sys.stderr)
    print("API key (shown only once, store it now):", file=sys.stderr)
    print(key)
    return EXIT_OK


def cmd_tenants_list(args: argparse.Namespace) -> int:
    for tenant in open_registry(args).list_tenants():
        print(f"{tenant.id}\t{tenant.name}\t{tenant.created_at:%Y-%m-%d %H:%M}")
    return EXIT_OK


def cmd_tenants_add_key(args: argparse.Namespace) -> int:
    key = open_registry(args).create_api_key(args.name, admin=args.admin, label=args.label)
    print("API key (shown only once, store it now):", file=sys.stderr)
    print(key)
    return EXIT_OK


def cmd_tenants_revoke_key(args: argparse.Namespace) -> int:
    if not open_registry(args).revoke_api_key(args.key):
        print("error: no such active key", file=sys.stderr)
        return EXIT_ERROR
    print("revoked")
    return EXIT_OK


# -- adapters -----------------------------------------------------------------------------


def add_adapter_commands(sub: argparse._SubParsersAction) -> None:
    adapters = sub.add_parser("adapters", help="tenants' LoRA adapters")
    asub = adapters.add_subparsers(dest="adapters_command", required=True)
    validate = asub.add_parser(
        "validate", parents=[model_options()], help="check an adapter folder or archive"
    )
    validate.add_argument("path")
    validate.set_defaults(func=cmd_adapters_validate)
    upload = asub.add_parser(
        "upload", parents=[registry_options(), model_options()], help="validate and register"
    )
    upload.add_argument("path", help="adapter folder, .tar.gz or .zip")
    upload.add_argument("--tenant", required=True)
    upload.add_argument("--name", required=True)
    upload.add_argument("--replace", action="store_true", help="replace an existing adapter")
    upload.add_argument("--preset", help="default sampling preset as JSON")
    upload.set_defaults(func=cmd_adapters_upload)
    lst = asub.add_parser("list", parents=[registry_options()], help="a tenant's adapters")
    lst.add_argument("--tenant", required=True)
    lst.add_argument("--json", action="store_true", help="one JSON object per line")
    lst.set_defaults(func=cmd_adapters_list)
    delete = asub.add_parser("delete", parents=[registry_options()], help="remove an adapter")
    delete.add_argument("name")
    delete.add_argument("--tenant", required=True)
    delete.set_defaults(func=cmd_adapters_delete)
    preset = asub.add_parser(
        "set-preset", parents=[registry_options()], help="default sampling preset"
    )
    preset.add_argument("name")
    preset.add_argument("preset", help="JSON object, or 'null' to clear")
    preset.add_argument("--tenant", required=True)
    preset.set_defaults(func=cmd_adapters_set_preset)


def cmd_adapters_validate(args: argparse.Namespace) -> int:
    from loramux.adapters.format import (
        DEFAULT_MAX_ADAPTER_BYTES,
        DEFAULT_MAX_LORA_RANK,
        validate_adapter,
    )

    base = resolve_base_model(args.base_model)
    config = json.loads((base / "config.json").read_text())
    weights = validate_adapter(
        args.path,
        config,
        max_lora_rank=args.max_lora_rank or DEFAULT_MAX_LORA_RANK,
        max_bytes=args.max_adapter_bytes or DEFAULT_MAX_ADAPTER_BYTES,
        base_model_name=config.get("_name_or_path") or base.name,
    )
    spec = weights.spec
    for warning in weights.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    print(
        f"ok: rank {spec.r}, alpha {spec.lora_alpha:g}, scale {spec.scale:g}, "
        f"modules {','.join(spec.target_modules)}, {len(weights.layers)} layers, "
        f"{weights.num_bytes()} bytes (base {base.name})"
    )
    return EXIT_OK


def _preset_arg(text: str | None) -> Any:
    if text is None:
        return None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise SystemExit(f"error: the preset is not valid JSON: {e}") from None


def cmd_adapters_upload(args: argparse.Namespace) -> int:
    registry = open_registry(args, with_model=True)
    handle = registry.upload(
        args.tenant,
        args.name,
        args.path,
        actor=actor(),
        replace=args.replace,
        default_preset=_preset_arg(args.preset),
    )
    print(
        f"uploaded {handle.name!r} v{handle.version} for tenant {args.tenant!r}: rank "
        f"{handle.rank}, {handle.size_bytes} bytes, sha256 {handle.sha256[:12]}"
    )
    return EXIT_OK


def cmd_adapters_list(args: argparse.Namespace) -> int:
    handles = open_registry(args).list(args.tenant)
    for h in handles:
        if args.json:
            print(json.dumps(h.to_dict(), sort_keys=True))
        else:
            print(
                f"{h.name}\tv{h.version}\trank {h.rank}\t{','.join(h.target_modules)}\t"
                f"{h.size_bytes} B\t{h.status}\t{h.updated_at:%Y-%m-%d %H:%M}"
            )
    if not handles and not args.json:
        print(f"tenant {args.tenant!r} has no adapters", file=sys.stderr)
    return EXIT_OK


def cmd_adapters_delete(args: argparse.Namespace) -> int:
    open_registry(args).delete(args.tenant, args.name, actor=actor())
    print(f"deleted {args.name!r}")
    return EXIT_OK


def cmd_adapters_set_preset(args: argparse.Namespace) -> int:
    handle = open_registry(args).set_preset(
        args.tenant, args.name, _preset_arg(args.preset), actor=actor()
    )
    print(json.dumps(handle.default_preset))
    return EXIT_OK


# -- export and maintenance -------------------------------------------------------------


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
    registry = open_registry(args, with_model=True)
    out = registry.export(
        args.tenant, args.name, args.out, check=args.check, actor=actor(), overwrite=args.overwrite
    )
    print(f"exported {args.name!r} merged into {registry.base_model_name} at {out}")
    return EXIT_OK


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


# -- entry point --------------------------------------------------------------------------


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
    from loramux.platform.serve import add_serve_command

    add_serve_command(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point (``loramux``); returns the exit status."""
    import logging

    from loramux.adapters.errors import AdapterValidationError
    from loramux.adapters.merge import MergeCheckError
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
    except (RegistryError, MergeCheckError, FileNotFoundError, FileExistsError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())
