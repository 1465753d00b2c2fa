"""Warm weights and cold starts taken apart: a model's weights choice, each load's phases and their tiers

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-03
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0014"
down_revision: str | Sequence[str] | None = "0013"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Written out, not imported: a migration states the schema of its day (app.residency.pagecache's
# WEIGHTS_CHOICES may grow later, with a migration of its own).
WEIGHTS_CHECK = "weights IS NULL OR weights IN ('pinned', 'warm', 'cold')"
LOAD_COLUMNS = ("load_read_ms", "load_context_ms", "load_upload_ms", "load_restore_ms", "first_prefill_ms")


def upgrade() -> None:
    """Add runner_settings.weights (NULL: warm, what every existing model gets) and the residency events' load
    split and sources (NULL on the events recorded before: not measured then)."""
    with op.batch_alter_table("runner_settings") as batch:
        batch.add_column(sa.Column("weights", sa.String(8), nullable=True))
        batch.create_check_constraint(op.f("ck_runner_settings_weights"), sa.text(WEIGHTS_CHECK))
    with op.batch_alter_table("residency_events") as batch:
        for name in LOAD_COLUMNS:
            batch.add_column(sa.Column(name, sa.Float(), nullable=True))
        batch.add_column(sa.Column("weights_source", sa.String(16), nullable=True))
        batch.add_column(sa.Column("kv_source", sa.String(8), nullable=True))


def downgrade() -> None:
    """Drop the columns and the check."""
    with op.batch_alter_table("residency_events") as batch:
        batch.drop_column("kv_source")
        batch.drop_column("weights_source")
        for name in reversed(LOAD_COLUMNS):
            batch.drop_column(name)
    with op.batch_alter_table("runner_settings") as batch:
        batch.drop_constraint(op.f("ck_runner_settings_weights"), type_="check")
        batch.drop_column("weights")
