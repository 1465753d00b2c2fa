"""Transcriptions in the request log: the audio's length, for the real-time factor the Requests page shows

Revision ID: 0021
Revises: 0020
Create Date: 2026-12-05
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0021"
down_revision: str | Sequence[str] | None = "0020"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Add requests.audio_seconds (NULL on the rows logged before, and on requests without a transcribed file)."""
    # Batch mode adds it with a plain ADD COLUMN (no table rebuild): the request log is the largest table.
    with op.batch_alter_table("requests") as batch:
        batch.add_column(sa.Column("audio_seconds", sa.Float(), nullable=True))


def downgrade() -> None:
    """Drop the column."""
    with op.batch_alter_table("requests") as batch:
        batch.drop_column("audio_seconds")
