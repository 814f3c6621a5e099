"""``loramux admin``: the dashboard's actions from a shell, through the admin JSON API.

    loramux admin adapters [--json]                      residency per engine
    loramux admin evict|pin|unpin|warm NAME --tenant T   (or NAME = an engine key)

The server is ``--url`` (default ``http://<host>:<port>`` of the serving settings); the
admin key is ``--admin-key`` or ``LORAMUX_ADMIN_KEY`` (it goes in a header, never a URL).
"""

from __future__ import annotations

import argparse
import json
import sys
from urllib.parse import quote

from loramux.platform.admin.actions import ACTIONS
from loramux.platform.cli.common import EXIT_ERROR, EXIT_OK
from loramux.platform.cli.flags import add_settings_arguments, settings_from_args


def _client_options() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False)
    g = p.add_argument_group("server")
    g.add_argument("--url", help="the server's base URL [default http://<host>:<port>]")
    add_settings_arguments(g, ("admin_key", "host", "port"))
    return p


def add_admin_commands(sub: argparse._SubParsersAction) -> None:
    admin = sub.add_parser("admin", help="operator actions through the admin API")
    asub = admin.add_subparsers(dest="admin_command", required=True)
    lst = asub.add_parser("adapters", parents=[_client_options()], help="adapter residency")
    lst.add_argument("--json", action="store_true", help="print the API's JSON")
    lst.set_defaults(func=cmd_admin_adapters)
    for action in ACTIONS:
        p = asub.add_parser(action, parents=[_client_options()], help=f"{action} an adapter")
        p.add_argument("name", help="the adapter's name (with --tenant) or its engine key")
        p.add_argument("--tenant", help="the tenant that owns NAME")
        p.add_argument("--engine", help="one engine's id [default: every engine]")
        p.set_defaults(func=cmd_admin_action, action=action)


def _request(args: argparse.Namespace, method: str, path: str, **kw):
    import httpx

    settings = settings_from_args(args)
    if settings.admin_key is None:
        raise SystemExit("error: the admin key is required: --admin-key or LORAMUX_ADMIN_KEY")
    url = (args.url or f"http://{settings.host}:{settings.port}").rstrip("/")
    headers = {"Authorization": f"Bearer {settings.admin_key.get_secret_value()}"}
    r = httpx.request(method, url + path, headers=headers, timeout=180, **kw)
    body = r.json() if r.headers.get("content-type", "").startswith("application/json") else {}
    if r.status_code >= 400:
        message = (body.get("error") or {}).get("message") or r.text
        raise SystemExit(f"error: {r.status_code}: {message}")
    return body


def cmd_admin_adapters(args: argparse.Namespace) -> int:
    data = _request(args, "GET", "/admin/adapters")
    if args.json:
        print(json.dumps(data, indent=2))
        return EXIT_OK
    print(f"{'TENANT':<12} {'ADAPTER':<24} {'ENGINE':<8} {'TIER':<7} {'SLOT':<4} {'PIN':<3} "
          f"{'INFL':>4} {'REQ/1m':>6}  KEY")
    for r in data["data"]:
        tenant = r["tenant"] or ("(all)" if r["source"] == "static" else "")
        slot = "" if r["slot"] is None else str(r["slot"])
        tier = r["tier"] + ("*" if r["evict_pending"] else "")
        print(f"{tenant:<12} {r['adapter'] or r['key']:<24} {r['engine']:<8} {tier:<7} "
              f"{slot:<4} {'yes' if r['pinned'] else '':<3} {r['in_flight']:>4} "
              f"{r['requests_1m']:>6}  {r['key']}")
    return EXIT_OK


def cmd_admin_action(args: argparse.Namespace) -> int:
    key = args.name
    if args.tenant is not None:
        rows = _request(args, "GET", "/admin/adapters")["data"]
        keys = {r["key"] for r in rows if r["tenant"] == args.tenant and r["adapter"] == args.name}
        if not keys:
            print(f"error: tenant {args.tenant!r} has no adapter {args.name!r}", file=sys.stderr)
            return EXIT_ERROR
        (key,) = keys
    quoted = "/".join(quote(p, safe="@") for p in key.split("/"))
    params = {"engine": args.engine} if args.engine else None
    result = _request(args, "POST", f"/admin/adapters/{quoted}/{args.action}", params=params)
    print(f"{result['action']} {result['key']}: {'done' if result['done'] else 'no change'}"
          + (f" ({result['detail']})" if result.get("detail") else ""))
    return EXIT_OK
