"""The tenant quota ``max_embedding_copy_bytes``: bytes of one adapter's embed_tokens / lm_head
rows that differ from the base (PEFT's full copies, ``adapters/full_copies.py``); and the
tenant's goodput objectives ``ttft_objective_ms`` / ``itl_objective_ms`` (NULL: the server's).

Tenants with their own quotas get 0 (such adapters refused until the operator allows them), as
the operator's default does; NULL means unlimited, as for every quota.

Revision ID: 0006_embedding_copy_quota
Revises: 0005_agents_api
Create Date: 2026-12-04
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006_embedding_copy_quota"
down_revision: str | Sequence[str] | None = "0005_agents_api"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("tenant_quotas") as batch:
        batch.add_column(sa.Column("max_embedding_copy_bytes", sa.BigInteger(), nullable=True))
        batch.add_column(sa.Column("ttft_objective_ms", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("itl_objective_ms", sa.Integer(), nullable=True))
    op.execute(sa.text("UPDATE tenant_quotas SET max_embedding_copy_bytes = 0"))


def downgrade() -> None:
    with op.batch_alter_table("tenant_quotas") as batch:
        batch.drop_column("itl_objective_ms")
        batch.drop_column("ttft_objective_ms")
        batch.drop_column("max_embedding_copy_bytes")
