"""Telemetry: series, 1-second samples, 1-minute and 1-hour rollups

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-29
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | Sequence[str] | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def _rollup_table(name: str) -> None:
    op.create_table(
        name,
        sa.Column("series_id", sa.Integer(), nullable=False),
        sa.Column("bucket", sa.Integer(), nullable=False),
        sa.Column("min", sa.Float(), nullable=False),
        sa.Column("max", sa.Float(), nullable=False),
        sa.Column("sum", sa.Float(), nullable=False),
        sa.Column("count", sa.Integer(), nullable=False),
        sa.ForeignKeyConstraint(["series_id"], ["series.id"], name=f"fk_{name}_series_id_series", ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("series_id", "bucket", name=f"pk_{name}"),
        sqlite_with_rowid=False,
    )


def upgrade() -> None:
    """Create series, samples, rollups_1m and rollups_1h (see the size math in models.py)."""
    op.create_table(
        "series",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("source", sa.String(255), nullable=False),
        sa.Column("metric", sa.String(64), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_series"),
        sa.UniqueConstraint("source", "metric", name="uq_series_source_metric"),
    )
    # WITHOUT ROWID: the (series_id, at) key is the table itself, so range reads need no second index.
    op.create_table(
        "samples",
        sa.Column("series_id", sa.Integer(), nullable=False),
        sa.Column("at", sa.Integer(), nullable=False),
        sa.Column("value", sa.Float(), nullable=False),
        sa.ForeignKeyConstraint(["series_id"], ["series.id"], name="fk_samples_series_id_series", ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("series_id", "at", name="pk_samples"),
        sqlite_with_rowid=False,
    )
    _rollup_table("rollups_1m")
    _rollup_table("rollups_1h")


def downgrade() -> None:
    """Drop the telemetry tables."""
    for name in ("rollups_1h", "rollups_1m", "samples", "series"):
        op.drop_table(name)
