"""``loramux tenants``: tenants and their API keys."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from loramux.platform.cli.common import EXIT_ERROR, EXIT_OK, registry_from_args, registry_options


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
    add_quota_command(tsub)


def _quota_value(text: str) -> int | None:
    if text.strip().lower() in ("none", "unlimited"):
        return None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected an integer or 'unlimited', got {text!r}") from None


def add_quota_command(tsub: argparse._SubParsersAction) -> None:
    """``loramux tenants quota TENANT [--requests-per-minute N ...] [--reset]``: one flag
    per :class:`~loramux.registry.quotas.Quotas` field (its declared doc is the help)."""
    from loramux.platform.settings import field_docs
    from loramux.registry.quotas import Quotas

    quota = tsub.add_parser(
        "quota", parents=[registry_options()],
        help="show or set a tenant's quotas (no flags: show)",
        description="Show a tenant's quotas, set some of them (the others keep their value; "
        "'unlimited' lifts one), or --reset to the server's defaults (--default-* flags of "
        "`loramux serve`).",
    )
    quota.add_argument("name", help="the tenant")
    docs = field_docs(Quotas)
    for f in dataclasses.fields(Quotas):
        quota.add_argument("--" + f.name.replace("_", "-"), dest=f.name, type=_quota_value,
                           default=argparse.SUPPRESS, metavar="N|unlimited", help=docs.get(f.name))
    quota.add_argument("--reset", action="store_true",
                       help="drop the tenant's own quotas: the defaults apply again")
    quota.set_defaults(func=cmd_tenants_quota)


def cmd_tenants_create(args: argparse.Namespace) -> int:
    registry = registry_from_args(args)
    tenant, key = registry.create_tenant(args.name, admin=args.admin)
    print(f"created tenant {tenant.name!r} (id {tenant.id})", file=sys.stderr)
    print("API key (shown only once, store it now):", file=sys.stderr)
    print(key)
    return EXIT_OK


def cmd_tenants_list(args: argparse.Namespace) -> int:
    for tenant in registry_from_args(args).list_tenants():
        print(f"{tenant.id}\t{tenant.name}\t{tenant.created_at:%Y-%m-%d %H:%M}")
    return EXIT_OK


def cmd_tenants_add_key(args: argparse.Namespace) -> int:
    key = registry_from_args(args).create_api_key(args.name, admin=args.admin, label=args.label)
    print("API key (shown only once, store it now):", file=sys.stderr)
    print(key)
    return EXIT_OK


def cmd_tenants_revoke_key(args: argparse.Namespace) -> int:
    if not registry_from_args(args).revoke_api_key(args.key):
        print("error: no such active key", file=sys.stderr)
        return EXIT_ERROR
    print("revoked")
    return EXIT_OK


def cmd_tenants_quota(args: argparse.Namespace) -> int:
    from loramux.registry.quotas import QUOTA_FIELDS, Quotas

    registry = registry_from_args(args)
    changes = {name: getattr(args, name) for name in QUOTA_FIELDS if hasattr(args, name)}
    if args.reset and changes:
        print("error: --reset takes no quota flags", file=sys.stderr)
        return EXIT_ERROR
    if args.reset:
        quotas = registry.set_quotas(args.name, None)
    elif changes:
        current = registry.get_quotas(args.name).to_dict()
        quotas = registry.set_quotas(args.name, Quotas(**{**current, **changes}))
    else:
        quotas = registry.get_quotas(args.name)
    usage = registry.get_usage(args.name)
    print(json.dumps({"tenant": args.name, "quotas": quotas.to_dict(),
                      "usage": dataclasses.asdict(usage)}, indent=2))
    return EXIT_OK
