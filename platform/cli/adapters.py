"""``loramux adapters``: validate, upload, list, delete, set-preset; releases: versions,
delete-version, rollout (show, set weights, follow the latest), rollback."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from loramux.platform.cli.common import (
    EXIT_OK,
    actor,
    model_options,
    registry_from_args,
    registry_options,
    resolve_base_model,
)
from loramux.platform.cli.flags import settings_from_args
from loramux.registry.rollouts import STICKY_MODES


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
    upload.add_argument("--replace", action="store_true",
                        help="accepted for older scripts: an upload to an existing name always "
                        "adds its next version")
    upload.add_argument("--preset", help="default sampling preset as JSON")
    upload.add_argument("--chat-template", metavar="FILE",
                        help="the adapter's own Jinja chat template (default: the "
                        "chat_template.jinja / tokenizer_config.json it ships; else it keeps "
                        "its current one)")
    upload.add_argument("--tool-call-parser", help="tool-call parser for this adapter's "
                        "requests (default: it keeps its own, else the server's)")
    upload.add_argument("--reasoning-parser", help="reasoning parser for this adapter's "
                        "requests (default: it keeps its own, else the server's)")
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
    versions = asub.add_parser("versions", parents=[registry_options()],
                               help="an adapter's versions and its rollout")
    versions.add_argument("name")
    versions.add_argument("--tenant", required=True)
    versions.add_argument("--json", action="store_true", help="one JSON object per line")
    versions.set_defaults(func=cmd_adapters_versions)
    delv = asub.add_parser("delete-version", parents=[registry_options()],
                           help="remove one version (not one the rollout names)")
    delv.add_argument("name")
    delv.add_argument("version", type=int)
    delv.add_argument("--tenant", required=True)
    delv.set_defaults(func=cmd_adapters_delete_version)
    rollout = asub.add_parser("rollout", parents=[registry_options()],
                              help="show or set how requests spread over versions")
    rollout.add_argument("name")
    rollout.add_argument("--tenant", required=True)
    how = rollout.add_mutually_exclusive_group()
    how.add_argument("--weights", help="percent per version, summing to 100: 3=90,4=10")
    how.add_argument("--follow-latest", action="store_true",
                     help="drop the explicit rollout: the newest version takes everything")
    rollout.add_argument("--sticky", choices=STICKY_MODES, default=None,
                         help="what keeps a caller on one version (default: user)")
    rollout.set_defaults(func=cmd_adapters_rollout)
    rollback = asub.add_parser("rollback", parents=[registry_options()],
                               help="every request to the previous live version")
    rollback.add_argument("name")
    rollback.add_argument("--tenant", required=True)
    rollback.set_defaults(func=cmd_adapters_rollback)


def cmd_adapters_validate(args: argparse.Namespace) -> int:
    from loramux.adapters.format import validate_adapter

    settings = settings_from_args(args)
    base = resolve_base_model(settings.model)
    config = json.loads((base / "config.json").read_text())
    weights = validate_adapter(
        args.path,
        config,
        max_lora_rank=settings.max_lora_rank,
        max_bytes=settings.max_adapter_bytes,
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
    """The ``--preset`` JSON, checked by the validator the HTTP API uses."""
    from loramux.platform.openai.presets import validate_preset

    if text is None:
        return None
    try:
        preset = json.loads(text)
    except json.JSONDecodeError as e:
        raise SystemExit(f"error: the preset is not valid JSON: {e}") from None
    return validate_preset(preset) if preset is not None else None


def _checked_chat(args: argparse.Namespace, folder) -> dict[str, str]:
    """The upload's chat settings (flags, else the template the folder ships), checked as
    the HTTP API checks them (parsers against the base model's tokenizer, one sandboxed
    render of the template)."""
    from pathlib import Path

    from loramux.platform.adapter_api.chat import check_offline
    from loramux.platform.builders import request_limits
    from loramux.registry.chat import read_chat_template

    chat = {k: v for k, v in (("tool_call_parser", args.tool_call_parser),
                              ("reasoning_parser", args.reasoning_parser)) if v}
    template = (Path(args.chat_template).read_text(encoding="utf-8") if args.chat_template
                else read_chat_template(folder))
    if template:
        chat["chat_template"] = template
    if chat:
        from transformers import AutoTokenizer

        settings = settings_from_args(args)
        base = resolve_base_model(settings.model)
        check_offline(chat, request_limits(settings), AutoTokenizer.from_pretrained(base),
                      base.name)
    return chat


def cmd_adapters_upload(args: argparse.Namespace) -> int:
    from loramux.adapters.archive import adapter_folder
    from loramux.adapters.spec import MAX_CONFIG_BYTES

    registry = registry_from_args(args, with_model=True)
    preset = _preset_arg(args.preset)
    with adapter_folder(args.path, max_bytes=registry.max_adapter_bytes + MAX_CONFIG_BYTES,
                        tmp_dir=registry.tmp_dir) as folder:
        handle = registry.upload(args.tenant, args.name, folder, actor=actor(),
                                 default_preset=preset, **_checked_chat(args, folder))
    print(
        f"uploaded {handle.name!r} v{handle.version} for tenant {args.tenant!r}: rank "
        f"{handle.rank}, {handle.size_bytes} bytes, sha256 {handle.sha256[:12]}"
    )
    return EXIT_OK


def cmd_adapters_list(args: argparse.Namespace) -> int:
    handles = registry_from_args(args).list(args.tenant)
    for h in handles:
        if args.json:
            print(json.dumps(h.to_dict(), sort_keys=True))
        else:
            print(
                f"{h.name}\tv{h.version}\trank {h.rank} {h.kind}\t{','.join(h.target_modules)}\t"
                f"{h.size_bytes} B\t{h.status}\t{h.updated_at:%Y-%m-%d %H:%M}"
            )
    if not handles and not args.json:
        print(f"tenant {args.tenant!r} has no adapters", file=sys.stderr)
    return EXIT_OK


def cmd_adapters_delete(args: argparse.Namespace) -> int:
    registry_from_args(args).delete(args.tenant, args.name, actor=actor())
    print(f"deleted {args.name!r}")
    return EXIT_OK


def cmd_adapters_set_preset(args: argparse.Namespace) -> int:
    handle = registry_from_args(args).set_preset(
        args.tenant, args.name, _preset_arg(args.preset), actor=actor()
    )
    print(json.dumps(handle.default_preset))
    return EXIT_OK


def _print_rollout(release) -> None:
    r = release.rollout
    split = ", ".join(f"v{v} {w}%" for v, w in r.weights)
    mode = " (follows the latest)" if r.follow_latest else ""
    back = f"v{r.rollback_to}" if r.rollback_to is not None else "none"
    print(f"{release.name}: {split}{mode}; sticky {r.sticky}; rollback to {back}")


def cmd_adapters_versions(args: argparse.Namespace) -> int:
    release = registry_from_args(args).release(args.tenant, args.name)
    for n, h in release.versions.items():
        if args.json:
            print(json.dumps({**h.to_dict(), "weight": release.rollout.weight(n)}, sort_keys=True))
        else:
            print(f"v{n}\t{release.rollout.weight(n)}%\trank {h.rank}\t{h.size_bytes} B\t"
                  f"sha256 {h.sha256[:12]}\t{h.created_at:%Y-%m-%d %H:%M}")
    if not args.json:
        _print_rollout(release)
    return EXIT_OK


def cmd_adapters_delete_version(args: argparse.Namespace) -> int:
    handle = registry_from_args(args).delete_version(args.tenant, args.name, args.version,
                                                     actor=actor())
    print(f"deleted {handle.name!r} v{handle.version}")
    return EXIT_OK


def _weights_arg(text: str) -> dict[str, int | str]:
    """``3=90,4=10`` as the API's JSON object (the registry checks the numbers)."""
    out: dict[str, int | str] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        version, sep, weight = part.partition("=")
        if not sep:
            raise SystemExit(f"error: --weights takes VERSION=PERCENT pairs, got {part!r}")
        out[version.strip().lstrip("v")] = int(weight) if weight.strip().lstrip("-").isdigit() \
            else weight.strip()
    return out


def cmd_adapters_rollout(args: argparse.Namespace) -> int:
    registry = registry_from_args(args)
    if args.follow_latest:
        release = registry.follow_latest(args.tenant, args.name, actor=actor())
    elif args.weights is not None:
        release = registry.set_rollout(args.tenant, args.name, _weights_arg(args.weights),
                                       args.sticky or "user", actor=actor())
    elif args.sticky is not None:
        current = registry.release(args.tenant, args.name).rollout
        release = registry.set_rollout(args.tenant, args.name,
                                       {str(v): w for v, w in current.weights}, args.sticky,
                                       actor=actor())
    else:
        release = registry.release(args.tenant, args.name)
    _print_rollout(release)
    return EXIT_OK


def cmd_adapters_rollback(args: argparse.Namespace) -> int:
    _print_rollout(registry_from_args(args).rollback(args.tenant, args.name, actor=actor()))
    return EXIT_OK
