"""A private class: its requests' prompts are never written to the runners' KV disk tier

Revision ID: 0019
Revises: 0018
Create Date: 2026-12-05
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0019"
down_revision: str | Sequence[str] | None = "0018"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Add request_classes.private (off for every existing class: what the disk tier did until now)."""
    with op.batch_alter_table("request_classes") as batch:
        batch.add_column(sa.Column("private", sa.Boolean(), nullable=False, server_default=sa.text("0")))


def downgrade() -> None:
    """Drop the column."""
    with op.batch_alter_table("request_classes") as batch:
        batch.drop_column("private")
