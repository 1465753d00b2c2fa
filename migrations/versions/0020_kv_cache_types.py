"""A model's KV cache types (-ctk / -ctv): q8_0 halves the KV cache, near enough, for a small cost in accuracy

Revision ID: 0020
Revises: 0018
Create Date: 2026-12-04
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0020"
# 0019 is another branch's, written beside this one; the merge chains them.
down_revision: str | Sequence[str] | None = "0018"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Add runner_settings.cache_type_k and cache_type_v (NULL: f16, what every model has)."""
    with op.batch_alter_table("runner_settings") as batch:
        batch.add_column(sa.Column("cache_type_k", sa.String(16), nullable=True))
        batch.add_column(sa.Column("cache_type_v", sa.String(16), nullable=True))


def downgrade() -> None:
    """Drop the columns."""
    with op.batch_alter_table("runner_settings") as batch:
        batch.drop_column("cache_type_v")
        batch.drop_column("cache_type_k")
