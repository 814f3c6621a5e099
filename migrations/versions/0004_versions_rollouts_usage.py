"""Immutable adapter versions, rollouts, the version retention quota and usage records.

Each adapter's weights move to ``adapter_versions`` (its current version becomes its one
version, keeping its number); ``adapters`` keeps what the versions share plus the rollout
(``rollout_weights`` NULL: the newest version takes every request). Tenants with their own
quotas get the default ``max_versions_per_adapter`` (5). Downgrading keeps each adapter's
newest version and drops the others, the rollouts and the usage records.

SQLite recreates a table to drop its columns, and dropping a table fires its foreign keys'
ON DELETE CASCADE; so ``adapters`` is rebuilt while no ``adapter_versions`` table points at
it (the rows are carried over in Python).

Revision ID: 0004_versions_rollouts_usage
Revises: 0003_tenant_quotas
Create Date: 2026-12-01
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004_versions_rollouts_usage"
down_revision: str | Sequence[str] | None = "0003_tenant_quotas"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

DEFAULT_MAX_VERSIONS = 5

_WEIGHT_COLUMNS = (
    sa.Column("base_model", sa.String(length=256)),
    sa.Column("rank", sa.Integer()),
    sa.Column("alpha", sa.Float()),
    sa.Column("target_modules", sa.JSON()),
    sa.Column("config", sa.JSON()),
    sa.Column("sha256", sa.String(length=64)),
    sa.Column("size_bytes", sa.BigInteger()),
    sa.Column("object_key", sa.String(length=512)),
)
WEIGHT_FIELDS = tuple(c.name for c in _WEIGHT_COLUMNS)


def _ts(name: str, nullable: bool = False) -> sa.Column:
    return sa.Column(name, sa.DateTime(timezone=True), nullable=nullable)


def _weight_columns(nullable: bool) -> list[sa.Column]:
    return [sa.Column(c.name, c.type, nullable=nullable) for c in _WEIGHT_COLUMNS]


def _create_versions() -> sa.Table:
    table = op.create_table(
        "adapter_versions",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("adapter_id", sa.Integer(), nullable=False),
        sa.Column("number", sa.Integer(), nullable=False),
        *_weight_columns(nullable=False),
        _ts("created_at"),
        sa.ForeignKeyConstraint(["adapter_id"], ["adapters.id"],
                                name=op.f("fk_adapter_versions_adapter_id_adapters"),
                                ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_adapter_versions")),
        sa.UniqueConstraint("adapter_id", "number",
                            name=op.f("uq_adapter_versions_adapter_id_number")),
    )
    op.create_index(op.f("ix_adapter_versions_object_key"), "adapter_versions", ["object_key"])
    op.create_index(op.f("ix_adapter_versions_sha256"), "adapter_versions", ["sha256"])
    return table


def upgrade() -> None:
    bind = op.get_bind()
    old = sa.table("adapters", sa.column("id", sa.Integer), sa.column("version", sa.Integer),
                   sa.column("updated_at", sa.DateTime(timezone=True)),
                   *(sa.column(c.name, c.type) for c in _WEIGHT_COLUMNS))
    carried = [dict(r._mapping) for r in bind.execute(sa.select(old))]

    op.drop_index(op.f("ix_adapters_object_key"), table_name="adapters")
    op.drop_index(op.f("ix_adapters_sha256"), table_name="adapters")
    with op.batch_alter_table("adapters") as batch:
        for name in WEIGHT_FIELDS:
            batch.drop_column(name)
        batch.alter_column("version", new_column_name="last_version",
                           existing_type=sa.Integer(), existing_nullable=False)
        batch.add_column(sa.Column("rollout_weights", sa.JSON(), nullable=True))
        batch.add_column(sa.Column("rollout_sticky", sa.String(length=8), nullable=False,
                                   server_default="user"))
        batch.add_column(sa.Column("previous_live", sa.Integer(), nullable=True))

    versions = _create_versions()
    if carried:
        op.bulk_insert(versions, [
            {"adapter_id": r["id"], "number": r["version"], "created_at": r["updated_at"],
             **{name: r[name] for name in WEIGHT_FIELDS}} for r in carried])

    with op.batch_alter_table("tenant_quotas") as batch:
        batch.add_column(sa.Column("max_versions_per_adapter", sa.Integer(), nullable=True))
    op.execute(sa.text("UPDATE tenant_quotas SET max_versions_per_adapter = :n")
               .bindparams(n=DEFAULT_MAX_VERSIONS))

    op.create_table(
        "usage_records",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column("request_id", sa.String(length=80), nullable=False),
        sa.Column("tenant_id", sa.Integer(), nullable=True),
        sa.Column("key_prefix", sa.String(length=16), nullable=True),
        sa.Column("adapter", sa.String(length=128), nullable=True),
        sa.Column("version", sa.Integer(), nullable=True),
        sa.Column("endpoint", sa.String(length=16), nullable=False),
        sa.Column("prompt_tokens", sa.Integer(), nullable=False),
        sa.Column("cached_tokens", sa.Integer(), nullable=False),
        sa.Column("completion_tokens", sa.Integer(), nullable=False),
        sa.Column("finish_reason", sa.String(length=32), nullable=True),
        sa.Column("error", sa.String(length=64), nullable=True),
        sa.Column("duration_ms", sa.Float(), nullable=False),
        sa.Column("ttft_ms", sa.Float(), nullable=True),
        sa.Column("tpot_ms", sa.Float(), nullable=True),
        sa.Column("day", sa.String(length=10), nullable=False),
        _ts("created_at"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_usage_records")),
        sa.UniqueConstraint("request_id", name=op.f("uq_usage_records_request_id")),
    )
    op.create_index(op.f("ix_usage_records_tenant_id_created_at"), "usage_records",
                    ["tenant_id", "created_at"])
    op.create_index(op.f("ix_usage_records_tenant_id_adapter_version_created_at"),
                    "usage_records", ["tenant_id", "adapter", "version", "created_at"])
    op.create_index(op.f("ix_usage_records_created_at"), "usage_records", ["created_at"])


def downgrade() -> None:
    bind = op.get_bind()
    op.drop_index(op.f("ix_usage_records_created_at"), table_name="usage_records")
    op.drop_index(op.f("ix_usage_records_tenant_id_adapter_version_created_at"),
                  table_name="usage_records")
    op.drop_index(op.f("ix_usage_records_tenant_id_created_at"), table_name="usage_records")
    op.drop_table("usage_records")
    with op.batch_alter_table("tenant_quotas") as batch:
        batch.drop_column("max_versions_per_adapter")

    versions = sa.table("adapter_versions", sa.column("adapter_id", sa.Integer),
                        sa.column("number", sa.Integer),
                        *(sa.column(c.name, c.type) for c in _WEIGHT_COLUMNS))
    newest: dict[int, dict] = {}
    for r in bind.execute(sa.select(versions).order_by(versions.c.number)):
        newest[r.adapter_id] = dict(r._mapping)  # the last one per adapter is its newest
    op.drop_index(op.f("ix_adapter_versions_sha256"), table_name="adapter_versions")
    op.drop_index(op.f("ix_adapter_versions_object_key"), table_name="adapter_versions")
    op.drop_table("adapter_versions")

    with op.batch_alter_table("adapters") as batch:
        batch.drop_column("previous_live")
        batch.drop_column("rollout_sticky")
        batch.drop_column("rollout_weights")
        batch.alter_column("last_version", new_column_name="version",
                           existing_type=sa.Integer(), existing_nullable=False)
        for column in _weight_columns(nullable=True):
            batch.add_column(column)
    adapters = sa.table("adapters", sa.column("id", sa.Integer), sa.column("version", sa.Integer),
                        *(sa.column(c.name, c.type) for c in _WEIGHT_COLUMNS))
    for adapter_id, v in newest.items():
        bind.execute(adapters.update().where(adapters.c.id == adapter_id).values(
            version=v["number"], **{name: v[name] for name in WEIGHT_FIELDS}))
    bind.execute(adapters.delete().where(adapters.c.sha256.is_(None)))  # no version left
    with op.batch_alter_table("adapters") as batch:
        for column in _WEIGHT_COLUMNS:
            batch.alter_column(column.name, existing_type=column.type, nullable=False)
    op.create_index(op.f("ix_adapters_sha256"), "adapters", ["sha256"])
    op.create_index(op.f("ix_adapters_object_key"), "adapters", ["object_key"])
