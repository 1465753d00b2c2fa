"""Preload schedule: the time-of-day loads an admin applied from the request log's profile

Revision ID: 0015
Revises: 0014
Create Date: 2026-12-03
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0015"
down_revision: str | Sequence[str] | None = "0014"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Written out, not imported: a migration states the schema of its day (app.store.models.PRELOAD_DAYS may grow
# later, with a migration of its own).
DAYS_CHECK = "days IN ('daily', 'weekdays', 'weekends')"


def upgrade() -> None:
    """Create preload_schedule: one row per model, day kind and local minute of the day to load it at."""
    op.create_table(
        "preload_schedule",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("model_name", sa.String(255), nullable=False),
        sa.Column("days", sa.String(16), nullable=False),
        sa.Column("at_minute", sa.Integer(), nullable=False),
        sa.Column("window_start_minute", sa.Integer(), nullable=False),
        sa.Column("window_end_minute", sa.Integer(), nullable=False),
        sa.Column("evidence", sa.Text(), nullable=False),
        sa.Column("applied_by", sa.String(128), nullable=False),
        sa.Column("applied_at", sa.DateTime(), nullable=False),
        sa.CheckConstraint(DAYS_CHECK, name=op.f("ck_preload_schedule_days")),
        sa.CheckConstraint("at_minute >= 0 AND at_minute < 1440", name=op.f("ck_preload_schedule_at_minute")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_preload_schedule")),
        sa.UniqueConstraint("model_name", "days", "at_minute", name=op.f("uq_preload_schedule_model_name_days_at_minute")),
    )


def downgrade() -> None:
    """Drop the table."""
    op.drop_table("preload_schedule")
