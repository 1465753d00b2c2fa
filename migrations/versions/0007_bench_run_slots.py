"""Bench runs keep the runner's slot count, so slot advice rests on measured slot counts

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-01
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | Sequence[str] | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Add bench_runs.slots (the started runner's parallel; NULL for runs stored before, and external targets)."""
    with op.batch_alter_table("bench_runs") as batch:
        batch.add_column(sa.Column("slots", sa.Integer(), nullable=True))


def downgrade() -> None:
    """Drop bench_runs.slots."""
    with op.batch_alter_table("bench_runs") as batch:
        batch.drop_column("slots")
