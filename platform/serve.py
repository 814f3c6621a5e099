"""``loramux serve``: the all-in-one server (engine + registry + HTTP) under uvicorn.

Flags mirror ``vllm serve`` where the meaning is the same; every flag left out falls
back to its ``LORAMUX_*`` environment variable, then to the default in
:class:`~loramux.platform.settings.Settings`.

On first start (a registry without tenants) it creates the admin key and, with
``--demo`` (the default), a ``demo`` tenant holding the shipped ``sql-lora`` adapter,
and prints both keys once; only their hashes are stored.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

DEMO_TENANT = "demo"
ADMIN_TENANT = "admin"
DEMO_ADAPTER = "sql-lora"
DEMO_PRESET = {"temperature": 0.0, "stop": [";"], "include_stop_str_in_output": True,
               "max_tokens": 128}


def add_serve_command(sub: argparse._SubParsersAction) -> None:
    """The ``serve`` subcommand (called by ``loramux.platform.cli.build_parser``)."""
    p = sub.add_parser(
        "serve", help="run the OpenAI-compatible server with the adapter API and admin dashboard",
        description="Serve the base model and tenants' LoRA adapters over HTTP.",
    )
    p.add_argument("model_arg", nargs="?", metavar="MODEL",
                   help="base model folder (like `vllm serve MODEL`); same as --model")
    e = p.add_argument_group("engine (vLLM names)")
    e.add_argument("--model", help="base model folder (default: SmolLM2-135M-Instruct)")
    e.add_argument("--served-model-name", nargs="+", help="names the base model answers to")
    e.add_argument("--dtype", help="auto | float32 | bfloat16 | float16 (CUDA)")
    e.add_argument("--device", help="auto | cpu | cuda[:N]")
    e.add_argument("--seed", type=int)
    e.add_argument("--max-model-len", type=int)
    e.add_argument("--max-num-seqs", type=int)
    e.add_argument("--max-num-batched-tokens", type=int)
    e.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=None,
                   help="split long prompts over steps so decodes keep going (default: on)")
    e.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                   help="reuse the KV of shared prompt prefixes, per adapter (default: on)")
    e.add_argument("--max-waiting", type=int, help="waiting-queue bound; past it 429")
    e.add_argument("--block-size", type=int)
    e.add_argument("--gpu-memory-utilization", type=float)
    e.add_argument("--kv-cache-memory", type=int, help="CPU: bytes for the KV cache")
    e.add_argument("--enable-lora", action=argparse.BooleanOptionalAction, default=None,
                   help="serve LoRA adapters (default: on)")
    e.add_argument("--max-loras", type=int)
    e.add_argument("--max-lora-rank", type=int)
    e.add_argument("--max-cpu-loras", type=int)
    e.add_argument("--lora-backend", help="auto | torch | triton")
    e.add_argument("--lora-modules", nargs="+", metavar="NAME=PATH",
                   help='static adapters every caller may use (also {"name":..,"path":..})')
    h = p.add_argument_group("HTTP")
    h.add_argument("--host", help="bind address (default 127.0.0.1)")
    h.add_argument("--port", type=int, help="default 8000")
    h.add_argument("--root-path")
    h.add_argument("--allow-anonymous", action=argparse.BooleanOptionalAction, default=None,
                   help="requests without a key may use the base model and --lora-modules")
    h.add_argument("--admin-key", help="the /admin key (default: generated once, stored hashed)")
    h.add_argument("--max-request-bytes", type=int)
    h.add_argument("--max-upload-bytes", type=int)
    h.add_argument("--log-level")
    h.add_argument("--log-format", choices=("json", "text"))
    r = p.add_argument_group("registry")
    r.add_argument("--database-url")
    r.add_argument("--s3-bucket")
    r.add_argument("--s3-endpoint-url")
    r.add_argument("--s3-prefix")
    r.add_argument("--data-dir")
    r.add_argument("--demo", action=argparse.BooleanOptionalAction, default=None,
                   help="first start: create a demo tenant with the sql-lora adapter (default on)")
    r.add_argument("--demo-adapter-dir")
    p.set_defaults(func=cmd_serve)


def settings_from_args(args: argparse.Namespace):
    """Settings from the flags given; the rest from ``LORAMUX_*`` and defaults."""
    from loramux.platform.settings import Settings

    values: dict[str, Any] = {}
    for key, value in vars(args).items():
        if key in ("func", "command", "verbose", "model_arg") or value is None:
            continue
        values[key] = value
    if args.model_arg and "model" not in values:
        values["model"] = args.model_arg
    return Settings(**values)


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from loramux.platform.app import create_app
    from loramux.platform.logs import configure_logging

    settings = settings_from_args(args)
    configure_logging(settings.log_level, settings.log_format)
    app = create_app(settings)
    app.state.on_ready = lambda state: bootstrap(state, out=sys.stdout)
    uvicorn.run(app, host=settings.host, port=settings.port, log_config=None,
                access_log=False, log_level=settings.log_level.lower())
    return 0


def default_demo_adapter() -> Path | None:
    """The shipped example adapter: ``examples/adapters/sql-lora`` of the checkout."""
    import loramux.platform as pkg

    roots = [Path(p).resolve().parent for p in pkg.__path__] + [Path.cwd()]
    for root in roots:
        folder = root / "examples" / "adapters" / DEMO_ADAPTER
        if (folder / "adapter_config.json").is_file():
            return folder
    return None


def bootstrap(state, out=None) -> dict[str, str]:
    """First-start setup; returns the keys it created (printed once to ``out``)."""
    registry = state.registry
    settings = state.settings
    created: dict[str, str] = {}
    if registry is None:
        return created
    tenants = {t.name: t for t in registry.list_tenants()}
    if settings.admin_key is None and ADMIN_TENANT not in tenants:
        _, created["admin"] = registry.create_tenant(ADMIN_TENANT, admin=True)
    if settings.demo:
        demo = tenants.get(DEMO_TENANT)
        if demo is None and not (set(tenants) - {ADMIN_TENANT}):
            demo, created["demo"] = registry.create_tenant(DEMO_TENANT)
        if demo is not None:
            _ensure_demo_adapter(registry, demo, settings)
    if created and out is not None:
        url = f"http://{settings.host}:{settings.port}"
        lines = ["", "=" * 72, "loramux: first start. These keys are shown once; only hashes are stored."]
        if "admin" in created:
            lines.append(f"  admin key ({url}/admin):  {created['admin']}")
        if "demo" in created:
            lines.append(f"  demo tenant key:             {created['demo']}")
            lines.append(
                f"  try: curl {url}/v1/chat/completions -H 'Authorization: Bearer {created['demo']}' "
                f"-H 'Content-Type: application/json' -d '{{\"model\": \"{DEMO_ADAPTER}\", "
                f"\"messages\": [{{\"role\": \"user\", \"content\": \"How many employees are there?\"}}]}}'"
            )
        lines += ["=" * 72, ""]
        print("\n".join(lines), file=out, flush=True)
    return created


def _ensure_demo_adapter(registry, demo, settings) -> None:
    from loramux.registry import AdapterNotFound

    try:
        registry.get(demo.id, DEMO_ADAPTER)
        return
    except AdapterNotFound:
        pass
    folder = Path(settings.demo_adapter_dir) if settings.demo_adapter_dir else default_demo_adapter()
    if folder is None or not folder.is_dir():
        logger.warning("no %s adapter to register for the demo tenant (looked for "
                       "examples/adapters/%s; train it with examples/train_sql_lora.py)",
                       DEMO_ADAPTER, DEMO_ADAPTER)
        return
    try:
        registry.upload(demo.id, DEMO_ADAPTER, folder, actor="serve:demo",
                        default_preset=DEMO_PRESET)
        logger.info("registered %s for the demo tenant from %s", DEMO_ADAPTER, folder)
    except Exception as e:  # a bad example adapter must not stop the server
        logger.warning("could not register the demo adapter from %s: %s", folder, e)
