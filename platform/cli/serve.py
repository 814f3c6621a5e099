"""``loramux serve``: the all-in-one server (engine + registry + HTTP) under uvicorn.

Its flags are generated from :class:`~loramux.platform.settings.Settings` (named like
``vllm serve``'s where the meaning is the same, help text from the field docstrings);
every flag left out falls back to its ``LORAMUX_*`` variable, then to the default.

On first start (a registry without tenants) it creates the admin key and, with
``--demo`` (the default), a ``demo`` tenant holding the shipped ``sql-lora`` adapter,
and prints both keys once; only their hashes are stored.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from loramux.platform.cli.flags import add_settings_arguments, settings_from_args
from loramux.platform.settings import Settings

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
    add_settings_arguments(p)
    p.set_defaults(func=cmd_serve)


def serve_settings(args: argparse.Namespace) -> Settings:
    """Settings from the flags given (the positional MODEL too); the rest from
    ``LORAMUX_*`` and the defaults."""
    model = args.model_arg if getattr(args, "model", None) is None else None
    return settings_from_args(args, model=model)


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from loramux.platform.app import create_app
    from loramux.platform.drain import AFTER_TIMEOUT_S, DrainingServer
    from loramux.platform.logs import configure_logging
    from loramux.platform.openai.tool_config import check_parser_flags

    settings = serve_settings(args)
    configure_logging(settings.log_level, settings.log_format)
    check_parser_flags(settings)  # vLLM refuses bad parser flags before loading the model
    if settings.tensor_parallel_size > 1:  # under torchrun, ranks but 0 are the engine's workers
        from loramux.engine.distributed.worker import run_launched_worker
        from loramux.platform.builders import engine_config

        if run_launched_worker(engine_config(settings).model, settings.tensor_parallel_timeout):
            return 0
    if settings.role != "all":
        from loramux.platform.cluster.roles import build_role_app

        app = build_role_app(settings, create_app)
    else:
        app = create_app(settings)
        app.on_ready = lambda state: bootstrap(state, out=sys.stdout)
    drain = app.drain  # the gateway app has none: uvicorn's own wait
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_config=None,
                            access_log=False, log_level=settings.log_level.lower(),
                            timeout_graceful_shutdown=AFTER_TIMEOUT_S if drain is not None
                            else settings.shutdown_timeout)
    DrainingServer(config, drain=drain, shutdown_timeout=settings.shutdown_timeout).run()
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
