"""Prompt tokens served from the runner's prefix cache, per request (usage.prompt_tokens_details.cached_tokens)

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-01
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009"
down_revision: str | Sequence[str] | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Add requests.cached_tokens (NULL: the runner did not say, as older rows and remote nodes)."""
    with op.batch_alter_table("requests") as batch:
        batch.add_column(sa.Column("cached_tokens", sa.Integer(), nullable=True))


def downgrade() -> None:
    """Drop requests.cached_tokens."""
    with op.batch_alter_table("requests") as batch:
        batch.drop_column("cached_tokens")
