"""Build a ``RegistryService`` from settings: the one place that knows the default layout.

Embedded default (``loramux serve`` on a laptop), everything in the data dir::

    <data dir>                      default: $XDG_DATA_HOME/loramux or ~/.local/share/loramux
    ├── loramux.db                  SQLite (WAL), schema upgraded automatically
    ├── objects/                    FileStore of adapter weights
    ├── cache/adapters/             fetched adapter folders
    └── tmp/                        upload scratch space

Production: ``database_url`` (PostgreSQL; run ``loramux db upgrade`` first) and
``s3_bucket`` (+ ``s3_endpoint_url`` for MinIO, R2, Ceph); the data dir then only holds
the cache and scratch space.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from loramux.adapters.format import DEFAULT_MAX_ADAPTER_BYTES
from loramux.adapters.spec import DEFAULT_MAX_LORA_RANK
from loramux.registry.budgets import DependencyBudgets
from loramux.registry.cache import AdapterCache
from loramux.registry.db import Database
from loramux.registry.presets import PresetCheck
from loramux.registry.quotas import Quotas
from loramux.registry.service import RegistryService
from loramux.registry.store import FileStore, ObjectStore

logger = logging.getLogger(__name__)


def default_data_dir() -> Path:
    """``$XDG_DATA_HOME/loramux``, else ``~/.local/share/loramux``."""
    xdg = os.environ.get("XDG_DATA_HOME")
    return (Path(xdg) if xdg else Path.home() / ".local" / "share") / "loramux"


def default_database_url(data_dir: str | os.PathLike | None = None) -> str:
    """The embedded SQLite database in the data dir."""
    return f"sqlite:///{Path(data_dir or default_data_dir()).resolve() / 'loramux.db'}"


def read_base_model(base_model: Any) -> tuple[dict[str, Any] | Any, str | None, Path | None]:
    """``(config, name, folder)`` from a model folder path, a config dict or a PretrainedConfig."""
    if base_model is None:
        return None, None, None
    if isinstance(base_model, str | os.PathLike):
        folder = Path(base_model)
        config_path = folder / "config.json"
        if not config_path.is_file():
            raise FileNotFoundError(f"{folder}: not a Hugging Face model folder (no config.json)")
        config = json.loads(config_path.read_text())
        return config, config.get("_name_or_path") or folder.name, folder
    if isinstance(base_model, dict):
        return base_model, base_model.get("_name_or_path"), None
    return base_model, getattr(base_model, "name_or_path", None) or None, None


def build_store(
    *,
    s3_bucket: str | None = None,
    s3_endpoint_url: str | None = None,
    s3_prefix: str = "",
    s3_region: str | None = None,
    data_dir: str | os.PathLike | None = None,
    budgets: DependencyBudgets | None = None,
) -> ObjectStore:
    """``S3Store`` when a bucket is given, else a ``FileStore`` in ``<data dir>/objects``."""
    if s3_bucket:
        from loramux.registry.s3 import S3Store

        return S3Store(s3_bucket, prefix=s3_prefix, region=s3_region, endpoint_url=s3_endpoint_url,
                       budgets=budgets)
    return FileStore(Path(data_dir or default_data_dir()) / "objects")


def build_registry(
    database_url: str | None = None,
    s3_bucket: str | None = None,
    s3_endpoint_url: str | None = None,
    s3_prefix: str = "",
    data_dir: str | os.PathLike | None = None,
    *,
    s3_region: str | None = None,
    base_model: Any = None,
    base_model_name: str | None = None,
    max_lora_rank: int = DEFAULT_MAX_LORA_RANK,
    max_adapter_bytes: int = DEFAULT_MAX_ADAPTER_BYTES,
    auto_upgrade: bool | None = None,
    store: ObjectStore | None = None,
    preset_check: PresetCheck | None = None,
    default_quotas: Quotas | None = None,
    budgets: DependencyBudgets | None = None,
) -> RegistryService:
    """The registry for these arguments; ``None`` ones fall back to the embedded layout
    (the service reads flags and environment in ``loramux.platform.settings``).

    ``base_model`` is the served model (a folder path, a config dict or a
    ``PretrainedConfig``); uploads are validated against it and export merges into it.
    ``preset_check`` is the serving side's preset validator (see ``registry.presets``).
    ``auto_upgrade`` (default: only for SQLite) runs the migrations; otherwise the schema
    must already be at head (``loramux db upgrade``) or :class:`SchemaOutOfDate` is raised.
    ``budgets`` bound every wait on the database and the object store.
    """
    data_dir = Path(data_dir or default_data_dir()).expanduser()
    data_dir.mkdir(parents=True, exist_ok=True)
    database_url = database_url or default_database_url(data_dir)
    db = Database(database_url, budgets=budgets)
    if auto_upgrade is None:
        auto_upgrade = db.is_sqlite
    if auto_upgrade:
        db.upgrade()
    else:
        db.check_schema()
    if store is None:
        store = build_store(
            s3_bucket=s3_bucket,
            s3_endpoint_url=s3_endpoint_url,
            s3_prefix=s3_prefix,
            s3_region=s3_region,
            data_dir=data_dir,
            budgets=budgets,
        )
    config, name, folder = read_base_model(base_model)
    registry = RegistryService(
        db,
        store,
        AdapterCache(data_dir / "cache" / "adapters"),
        base_config=config,
        base_model_name=base_model_name or name,
        base_model_path=folder,
        max_lora_rank=max_lora_rank,
        max_adapter_bytes=max_adapter_bytes,
        tmp_dir=data_dir / "tmp",
        preset_check=preset_check,
        default_quotas=default_quotas,
    )
    try:  # what a process killed mid-upload left (scratch, temporary pieces)
        registry.remove_leftovers()
    except Exception as e:  # a store down at start must not keep the server down
        logger.warning("could not remove crash leftovers at start: %s", e)
    return registry
