"""Alembic: an empty database goes up to head and back down; models and migrations agree."""

from __future__ import annotations

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import Column, Integer, MetaData, Table, inspect

from loramux.registry import SchemaOutOfDate
from loramux.registry.db import Database, migrations_dir
from loramux.registry.models import Base

TABLES = {"tenants", "api_keys", "adapters", "adapter_events", "tenant_quotas"}


def diff(db: Database, metadata: MetaData = Base.metadata) -> list:
    with db.engine.connect() as conn:
        ctx = MigrationContext.configure(conn, opts={"compare_type": True})
        return compare_metadata(ctx, metadata)


def test_upgrade_downgrade_and_no_drift(database_url):
    db = Database(database_url)
    assert db.current_revision() is None
    with pytest.raises(SchemaOutOfDate, match="loramux db upgrade"):
        db.check_schema()
    db.upgrade()
    assert db.current_revision() == db.head_revision()
    db.check_schema()
    assert TABLES <= set(inspect(db.engine).get_table_names())
    assert diff(db) == []
    db.downgrade("base")
    assert db.current_revision() is None
    assert not TABLES & set(inspect(db.engine).get_table_names())
    db.upgrade()  # and up again
    assert diff(db) == []
    db.dispose()


def test_drift_would_be_caught(database_url):
    """The comparison is not vacuous: a column the migrations lack shows up."""
    db = Database(database_url)
    db.upgrade()
    drifted = MetaData()
    for table in Base.metadata.tables.values():
        table.to_metadata(drifted)
    Table("adapters", drifted, Column("extra", Integer), extend_existing=True)
    assert any(d[0] == "add_column" for d in diff(db, drifted))
    db.dispose()


def test_sqlite_pragmas(tmp_path):
    db = Database(f"sqlite:///{tmp_path / 'x.db'}")
    with db.engine.connect() as conn:
        assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
        assert conn.exec_driver_sql("PRAGMA foreign_keys").scalar() == 1
    db.dispose()


def test_migrations_found_without_repo_cwd(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert (migrations_dir() / "env.py").is_file()
    db = Database(f"sqlite:///{tmp_path / 'y.db'}")
    db.upgrade()
    assert db.current_revision() == db.head_revision()
    db.dispose()
