"""Images in the request log: how many a request's prompt held and how long the runner spent encoding them

Revision ID: 0017
Revises: 0015
Create Date: 2026-12-03
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0017"
down_revision: str | Sequence[str] | None = "0015"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Add requests.images and requests.image_encode_ms (NULL on the rows logged before, and on text requests)."""
    # Batch mode adds these with a plain ADD COLUMN (no table rebuild): the request log is the largest table.
    with op.batch_alter_table("requests") as batch:
        batch.add_column(sa.Column("images", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("image_encode_ms", sa.Float(), nullable=True))


def downgrade() -> None:
    """Drop the columns."""
    with op.batch_alter_table("requests") as batch:
        batch.drop_column("image_encode_ms")
        batch.drop_column("images")
