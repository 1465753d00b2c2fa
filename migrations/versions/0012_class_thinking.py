"""A request class's thinking default: model (leave it to the model), off or on; voice is off

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-02
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0012"
down_revision: str | Sequence[str] | None = "0011"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Add request_classes.thinking ("model" for every class), then turn it off for voice, as a new store
    seeds it: Home Assistant speaks voice answers, and no admin could have chosen otherwise before."""
    with op.batch_alter_table("request_classes") as batch:
        batch.add_column(sa.Column("thinking", sa.String(8), nullable=False, server_default="model"))
    op.execute("UPDATE request_classes SET thinking = 'off' WHERE name = 'voice'")


def downgrade() -> None:
    """Drop the column."""
    with op.batch_alter_table("request_classes") as batch:
        batch.drop_column("thinking")
