"""The registry's dependency budgets reach its clients: PostgreSQL gets a connect and a
statement timeout (a statement past it fails fast, migrations are exempt), the S3 client
a connect and read timeout and a bounded retry budget."""

from __future__ import annotations

import time

import pytest
from sqlalchemy import text
from sqlalchemy.exc import OperationalError

from loramux.registry.budgets import DependencyBudgets
from loramux.registry.db import Database


@pytest.mark.latency
def test_postgres_statement_timeout(postgres_url):
    db = Database(postgres_url, budgets=DependencyBudgets(db_statement_timeout=0.5))
    try:
        with db.engine.connect() as conn:
            assert conn.execute(text("SHOW statement_timeout")).scalar() == "500ms"
            # the test's own search_path option survives beside the timeouts
            assert conn.execute(text("SHOW search_path")).scalar().startswith("lmx_test_")
        t0 = time.monotonic()
        with pytest.raises(OperationalError), db.engine.connect() as conn:
            conn.execute(text("SELECT pg_sleep(10)"))
        assert time.monotonic() - t0 < 3
        db.upgrade()  # migrations run without the statement timeout
        assert db.current_revision() == db.head_revision()
    finally:
        db.dispose()


@pytest.mark.latency
def test_postgres_connect_timeout_is_bounded():
    """A address that never answers (TEST-NET-1) fails within the connect budget."""
    db = Database("postgresql+psycopg://u@192.0.2.1:5432/x",
                  budgets=DependencyBudgets(db_connect_timeout=1.0))
    t0 = time.monotonic()
    with pytest.raises(OperationalError), db.engine.connect():
        pass
    assert time.monotonic() - t0 < 5
    db.dispose()


@pytest.mark.latency
def test_s3_client_budgets():
    from loramux.registry.s3 import S3Store

    store = S3Store("b", endpoint_url="http://127.0.0.1:9",
                    budgets=DependencyBudgets(s3_connect_timeout=0.7, s3_read_timeout=1.3,
                                              s3_max_attempts=2))
    config = store.client.meta.config
    assert config.connect_timeout == 0.7 and config.read_timeout == 1.3
    assert config.retries["total_max_attempts"] == 2
    t0 = time.monotonic()
    from loramux.registry.errors import ObjectStoreError
    with pytest.raises(ObjectStoreError):
        store.exists("adapters/x")  # nothing listens on port 9
    assert time.monotonic() - t0 < 5


def test_budgets_refuse_nonsense():
    with pytest.raises(ValueError):
        DependencyBudgets(s3_read_timeout=0)
    with pytest.raises(ValueError):
        DependencyBudgets(s3_max_attempts=0)
