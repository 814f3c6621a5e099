"""Registry fixtures: the registry tests run over a backend matrix, a database (SQLite,
PostgreSQL) times an object store (the FileStore, an S3Store against a moto S3 server on
loopback). By default only SQLite with the FileStore; ``LORAMUX_TEST_BACKENDS=all`` (set
by ``.ci/run``) runs all four (:data:`DATABASES`, :data:`STORES`).

PostgreSQL: ``LORAMUX_TEST_POSTGRES_URL`` (default
``postgresql+psycopg://postgres@127.0.0.1:5432/test``); each test gets its own schema
(``search_path``), dropped afterwards. S3: ``moto.server.ThreadedMotoServer`` on a free
127.0.0.1 port for the session; each test gets its own bucket. An absent service skips
its tests, except under ``CI=true`` where it fails them.
"""

from __future__ import annotations

import os
import socket
import uuid
from pathlib import Path

import pytest
from support.services import require_service

PG_URL = os.environ.get(
    "LORAMUX_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"
)

ALL_BACKENDS = os.environ.get("LORAMUX_TEST_BACKENDS", "").strip().lower() == "all"
DATABASES = ["sqlite", "postgresql"] if ALL_BACKENDS else ["sqlite"]
"""The databases the ``database_url`` fixture (and so ``registry``) is parametrized over."""
STORES = ["file", "s3"] if ALL_BACKENDS else ["file"]
"""The object stores the ``object_store`` fixture (and so ``registry``) is parametrized over."""

TINY_CONFIG = {
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}


def _postgres_reachable() -> bool:
    from sqlalchemy import create_engine, text

    try:
        engine = create_engine(PG_URL, connect_args={"connect_timeout": 3})
        with engine.connect() as conn:
            conn.execute(text("select 1"))
        engine.dispose()
        return True
    except Exception:
        return False


@pytest.fixture(scope="session")
def postgres_available() -> bool:
    return _postgres_reachable()


@pytest.fixture
def postgres_url(postgres_available):
    """A PostgreSQL URL whose search_path is a fresh, private schema."""
    require_service(postgres_available, f"PostgreSQL ({PG_URL})")
    from sqlalchemy import create_engine

    schema = f"lmx_test_{uuid.uuid4().hex[:12]}"
    admin = create_engine(PG_URL)
    with admin.begin() as conn:
        conn.exec_driver_sql(f'CREATE SCHEMA "{schema}"')
    sep = "&" if "?" in PG_URL else "?"
    yield f"{PG_URL}{sep}options=-csearch_path%3D{schema}"
    with admin.begin() as conn:
        conn.exec_driver_sql(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
    admin.dispose()


@pytest.fixture(params=DATABASES)
def database_url(request, tmp_path):
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'registry.db'}"
    return request.getfixturevalue("postgres_url")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def moto_endpoint():
    """An S3 endpoint URL served by moto in server mode on loopback."""
    try:
        from moto.server import ThreadedMotoServer
    except ImportError:  # pragma: no cover
        require_service(False, "moto[server] (S3 test server)")
    port = _free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    try:
        server.start()
    except Exception as e:  # pragma: no cover
        require_service(False, f"moto S3 server on 127.0.0.1:{port} ({e})")
    yield f"http://127.0.0.1:{port}"
    server.stop()


@pytest.fixture
def make_s3_store(moto_endpoint):
    """``make_s3_store(**kwargs)`` → an S3Store on a new bucket of the moto server."""
    from loramux.registry.s3 import S3Store

    def make(**kwargs):
        store = S3Store(
            f"lmx-{uuid.uuid4().hex[:16]}",
            endpoint_url=moto_endpoint,
            region="us-east-1",
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
            **kwargs,
        )
        store.create_bucket()
        return store

    return make


@pytest.fixture(params=STORES)
def object_store(request, tmp_path):
    if request.param == "file":
        from loramux.registry.store import FileStore

        return FileStore(tmp_path / "objects")
    return request.getfixturevalue("make_s3_store")(prefix="loramux/test")


@pytest.fixture
def registry(database_url, object_store, tmp_path):
    """A RegistryService over each database × store, validating against a tiny Llama config."""
    from loramux.platform.openai.presets import registry_preset_check
    from loramux.registry import build_registry

    service = build_registry(
        database_url=database_url,
        data_dir=tmp_path / "data",
        store=object_store,
        base_model=dict(TINY_CONFIG),
        base_model_name="tiny-llama",
        max_lora_rank=16,
        max_adapter_bytes=64 * 1024,
        auto_upgrade=True,
        preset_check=registry_preset_check,
    )
    yield service
    service.db.dispose()


@pytest.fixture
def make_adapter(tmp_path):
    """``make_adapter(name="a", **random_lora kwargs)`` → a PEFT folder for the tiny config."""
    from support.adapters import write_random_adapter

    def make(name: str = "adapter", **kwargs) -> Path:
        kwargs.setdefault("r", 4)
        kwargs.setdefault("base_model_name_or_path", "tiny-llama")
        return write_random_adapter(TINY_CONFIG, tmp_path / "src" / name, **kwargs)

    return make
