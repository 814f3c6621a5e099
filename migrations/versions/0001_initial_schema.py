"""Initial schema: tenants, API keys, adapters, adapter events.

Revision ID: 0001
Revises:
Create Date: 2026-11-29
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | Sequence[str] | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def _ts(name: str, nullable: bool = False) -> sa.Column:
    return sa.Column(name, sa.DateTime(timezone=True), nullable=nullable)


def upgrade() -> None:
    _create_tenants()
    _create_api_keys()
    _create_adapters()
    _create_adapter_events()


def _create_tenants() -> None:
    """``tenants``: one row per tenant, unique by name."""
    op.create_table(
        "tenants",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=128), nullable=False),
        _ts("created_at"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_tenants")),
        sa.UniqueConstraint("name", name=op.f("uq_tenants_name")),
    )


def _create_api_keys() -> None:
    """``api_keys``: hashed keys of a tenant (unique prefix), indexed by tenant."""
    op.create_table(
        "api_keys",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("tenant_id", sa.Integer(), nullable=False),
        sa.Column("prefix", sa.String(length=16), nullable=False),
        sa.Column("key_hash", sa.String(length=256), nullable=False),
        sa.Column("is_admin", sa.Boolean(), nullable=False),
        sa.Column("label", sa.String(length=128), nullable=True),
        _ts("created_at"),
        _ts("last_used_at", nullable=True),
        _ts("revoked_at", nullable=True),
        sa.ForeignKeyConstraint(
            ["tenant_id"],
            ["tenants.id"],
            name=op.f("fk_api_keys_tenant_id_tenants"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_api_keys")),
        sa.UniqueConstraint("prefix", name=op.f("uq_api_keys_prefix")),
    )
    op.create_index(op.f("ix_api_keys_tenant_id"), "api_keys", ["tenant_id"])


def _create_adapters() -> None:
    """``adapters``: one row per tenant adapter (unique name per tenant), indexed by object
    key and sha256."""
    op.create_table(
        "adapters",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("tenant_id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=128), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("base_model", sa.String(length=256), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("alpha", sa.Float(), nullable=False),
        sa.Column("target_modules", sa.JSON(), nullable=False),
        sa.Column("config", sa.JSON(), nullable=False),
        sa.Column("sha256", sa.String(length=64), nullable=False),
        sa.Column("size_bytes", sa.BigInteger(), nullable=False),
        sa.Column("object_key", sa.String(length=512), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("default_preset", sa.JSON(), nullable=True),
        _ts("created_at"),
        _ts("updated_at"),
        sa.ForeignKeyConstraint(
            ["tenant_id"],
            ["tenants.id"],
            name=op.f("fk_adapters_tenant_id_tenants"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_adapters")),
        sa.UniqueConstraint("tenant_id", "name", name=op.f("uq_adapters_tenant_id_name")),
    )
    op.create_index(op.f("ix_adapters_object_key"), "adapters", ["object_key"])
    op.create_index(op.f("ix_adapters_sha256"), "adapters", ["sha256"])


def _create_adapter_events() -> None:
    """``adapter_events``: the audit log, indexed by adapter and by tenant and time."""
    op.create_table(
        "adapter_events",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("tenant_id", sa.Integer(), nullable=True),
        sa.Column("adapter_id", sa.Integer(), nullable=True),
        sa.Column("adapter_name", sa.String(length=128), nullable=False),
        sa.Column("kind", sa.String(length=16), nullable=False),
        sa.Column("actor", sa.String(length=128), nullable=True),
        sa.Column("details", sa.JSON(), nullable=True),
        _ts("created_at"),
        sa.ForeignKeyConstraint(
            ["tenant_id"],
            ["tenants.id"],
            name=op.f("fk_adapter_events_tenant_id_tenants"),
            ondelete="SET NULL",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_adapter_events")),
    )
    op.create_index(op.f("ix_adapter_events_adapter_id"), "adapter_events", ["adapter_id"])
    op.create_index(
        op.f("ix_adapter_events_tenant_id_created_at"),
        "adapter_events",
        ["tenant_id", "created_at"],
    )


def downgrade() -> None:
    op.drop_index(op.f("ix_adapter_events_tenant_id_created_at"), table_name="adapter_events")
    op.drop_index(op.f("ix_adapter_events_adapter_id"), table_name="adapter_events")
    op.drop_table("adapter_events")
    op.drop_index(op.f("ix_adapters_sha256"), table_name="adapters")
    op.drop_index(op.f("ix_adapters_object_key"), table_name="adapters")
    op.drop_table("adapters")
    op.drop_index(op.f("ix_api_keys_tenant_id"), table_name="api_keys")
    op.drop_table("api_keys")
    op.drop_table("tenants")
