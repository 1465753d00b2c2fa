"""What a request used beyond plain generation (tools, structured output, fill-in-the-middle, logprobs)

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-02
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | Sequence[str] | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Add requests.features: a comma-separated list such as "tools,json_schema", NULL for plain requests."""
    with op.batch_alter_table("requests") as batch:
        batch.add_column(sa.Column("features", sa.String(64), nullable=True))


def downgrade() -> None:
    """Drop requests.features."""
    with op.batch_alter_table("requests") as batch:
        batch.drop_column("features")
