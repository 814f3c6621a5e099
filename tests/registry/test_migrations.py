"""Alembic: an empty database goes up to head and back down; models and migrations agree."""

from __future__ import annotations

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import Column, Integer, MetaData, Table, inspect

from loramux.registry import SchemaOutOfDate
from loramux.registry.db import Database, migrations_dir
from loramux.registry.models import Base

TABLES = {"tenants", "api_keys", "adapters", "adapter_events", "tenant_quotas",
          "adapter_versions", "usage_records"}


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


def test_versions_migration_carries_the_data_both_ways(database_url):
    """0004 moves each adapter's weights into its one version (keeping its number) and
    back down to the newest version; the quota rows get the default retention."""
    from sqlalchemy import text

    db = Database(database_url)
    db.upgrade("0003_tenant_quotas")
    now = "2026-11-30 12:00:00+00:00"
    with db.engine.begin() as c:
        c.execute(text("INSERT INTO tenants (id, name, created_at) VALUES (1, 'acme', :t)"),
                  {"t": now})
        c.execute(text(
            "INSERT INTO adapters (id, tenant_id, name, version, base_model, rank, alpha, "
            "target_modules, config, sha256, size_bytes, object_key, status, created_at, "
            "updated_at) VALUES (7, 1, 'sql', 3, 'tiny', 4, 8.0, :tm, :cfg, :sha, 123, :key, "
            "'ready', :t, :t)"),
            {"tm": '["q_proj"]', "cfg": '{"r": 4}', "sha": "ab" * 32,
             "key": f"adapters/sha256/{'ab' * 32}/adapter_model.safetensors", "t": now})
        c.execute(text("INSERT INTO tenant_quotas (tenant_id, max_adapters, updated_at) "
                       "VALUES (1, 9, :t)"), {"t": now})
    db.upgrade()
    with db.engine.connect() as c:
        row = c.execute(text("SELECT adapter_id, number, rank, sha256, size_bytes "
                             "FROM adapter_versions")).one()
        assert tuple(row) == (7, 3, 4, "ab" * 32, 123)
        a = c.execute(text("SELECT last_version, rollout_weights, rollout_sticky, "
                           "previous_live FROM adapters")).one()
        assert tuple(a) == (3, None, "user", None)
        assert c.execute(text("SELECT max_versions_per_adapter FROM tenant_quotas")).scalar() == 5
    db.downgrade("0003_tenant_quotas")
    with db.engine.connect() as c:
        row = c.execute(text("SELECT id, version, rank, sha256, size_bytes, object_key "
                             "FROM adapters")).one()
        assert tuple(row)[:5] == (7, 3, 4, "ab" * 32, 123)
    db.dispose()
