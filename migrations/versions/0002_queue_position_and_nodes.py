"""Queue position on requests; nodes (remote runners serving a model)

Revision ID: 0002
Revises: 0001
Create Date: 2025-01-02
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | Sequence[str] | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Add requests.queue_position and the nodes table."""
    # A nullable column without a default: SQLite adds it in place, no table rebuild.
    with op.batch_alter_table("requests") as batch:
        batch.add_column(sa.Column("queue_position", sa.Integer(), nullable=True))
    op.create_table(
        "nodes",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("model_id", sa.Integer(), nullable=False),
        sa.Column("url", sa.Text(), nullable=False),
        sa.Column("label", sa.String(128), nullable=True),
        sa.Column("enabled", sa.Boolean(), server_default=sa.text("1"), nullable=False),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.ForeignKeyConstraint(["model_id"], ["models.id"], name="fk_nodes_model_id_models", ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name="pk_nodes"),
        sa.UniqueConstraint("model_id", "url", name="uq_nodes_model_id_url"),
    )
    op.create_index("ix_nodes_model_id", "nodes", ["model_id"])


def downgrade() -> None:
    """Drop the nodes table and requests.queue_position."""
    op.drop_index("ix_nodes_model_id", table_name="nodes")
    op.drop_table("nodes")
    with op.batch_alter_table("requests") as batch:
        batch.drop_column("queue_position")
