"""The agents' API: per-adapter chat template and parsers, stored Responses API responses.

``adapters`` gains ``chat_template`` (the adapter's own Jinja template), ``tool_call_parser``
and ``reasoning_parser`` (parser names for its requests; NULL = the server's).
``stored_responses`` keeps each tenant's stored ``/v1/responses`` results (``store: true``)
for ``previous_response_id`` and ``GET``/``DELETE /v1/responses/{id}``.

Revision ID: 0005_agents_api
Revises: 0004_versions_rollouts_usage
Create Date: 2026-12-04
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005_agents_api"
down_revision: str | Sequence[str] | None = "0004_versions_rollouts_usage"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("adapters", sa.Column("chat_template", sa.Text(), nullable=True))
    op.add_column("adapters", sa.Column("tool_call_parser", sa.String(length=64), nullable=True))
    op.add_column("adapters", sa.Column("reasoning_parser", sa.String(length=64), nullable=True))
    op.create_table(
        "stored_responses",
        sa.Column("id", sa.String(length=80), nullable=False),
        sa.Column("tenant_id", sa.Integer(), nullable=False),
        sa.Column("model", sa.String(length=256), nullable=False),
        sa.Column("previous_response_id", sa.String(length=80), nullable=True),
        sa.Column("body", sa.JSON(), nullable=False),
        sa.Column("conversation", sa.JSON(), nullable=False),
        sa.Column("size_bytes", sa.BigInteger(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["tenant_id"], ["tenants.id"], ondelete="CASCADE",
                                name=op.f("fk_stored_responses_tenant_id_tenants")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_stored_responses")),
    )
    op.create_index(op.f("ix_stored_responses_tenant_id_created_at"), "stored_responses",
                    ["tenant_id", "created_at"])


def downgrade() -> None:
    op.drop_index(op.f("ix_stored_responses_tenant_id_created_at"), table_name="stored_responses")
    op.drop_table("stored_responses")
    # plain ALTER TABLE ... DROP COLUMN (PostgreSQL; SQLite >= 3.35): a batch rebuild of
    # ``adapters`` on SQLite would drop the table and cascade to ``adapter_versions``
    for column in ("reasoning_parser", "tool_call_parser", "chat_template"):
        op.execute(f"ALTER TABLE adapters DROP COLUMN {column}")
