"""A model's draft model: another catalog model of its vocabulary that drafts for it (--spec-type draft-simple)

Revision ID: 0018
Revises: 0017
Create Date: 2026-12-03
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0018"
down_revision: str | Sequence[str] | None = "0017"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Add runner_settings.draft_model: the catalog name of the draft model (NULL: none, what every model has)."""
    with op.batch_alter_table("runner_settings") as batch:
        batch.add_column(sa.Column("draft_model", sa.String(255), nullable=True))


def downgrade() -> None:
    """Drop the column."""
    with op.batch_alter_table("runner_settings") as batch:
        batch.drop_column("draft_model")
