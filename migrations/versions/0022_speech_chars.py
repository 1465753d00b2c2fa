"""Speech out in the request log: the characters a /v1/audio/speech or Wyoming synthesis spoke

Revision ID: 0022
Revises: 0021
Create Date: 2026-12-06
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0022"
down_revision: str | Sequence[str] | None = "0021"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Add requests.input_chars (NULL on the rows logged before, and on requests that spoke nothing)."""
    with op.batch_alter_table("requests") as batch:
        batch.add_column(sa.Column("input_chars", sa.Integer(), nullable=True))


def downgrade() -> None:
    """Drop the column."""
    with op.batch_alter_table("requests") as batch:
        batch.drop_column("input_chars")
