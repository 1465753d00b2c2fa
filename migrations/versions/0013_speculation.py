"""Speculative decoding: a model's setting (auto / off / a type), a class's switch, each request's drafts

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-10
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0013"
down_revision: str | Sequence[str] | None = "0012"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Written out, not imported: a migration states the schema of its day (app.residency.supervisor's
# SPECULATION_SETTINGS may grow later, with a migration of its own).
SPECULATION_CHECK = ("speculation IS NULL OR speculation IN ('auto', 'off', 'ngram-lookup', 'ngram-simple', "
                     "'ngram-map-k', 'ngram-map-k4v', 'ngram-mod')")


def upgrade() -> None:
    """Add runner_settings.speculation (NULL: auto, what every existing model gets), request_classes.speculation
    (on for every class: drafting is switched by load, a class only opts out), and the requests' draft counts
    (NULL on the rows logged before: nothing drafted then)."""
    with op.batch_alter_table("runner_settings") as batch:
        batch.add_column(sa.Column("speculation", sa.String(16), nullable=True))
        # Named as the models' naming convention names it (ck_<table>_<name>), not doubled as 0001's are.
        batch.create_check_constraint(op.f("ck_runner_settings_speculation"), sa.text(SPECULATION_CHECK))
    with op.batch_alter_table("request_classes") as batch:
        batch.add_column(sa.Column("speculation", sa.Boolean(), nullable=False, server_default=sa.text("1")))
    # Batch mode adds these with a plain ADD COLUMN (no table rebuild): the request log is the largest table.
    with op.batch_alter_table("requests") as batch:
        batch.add_column(sa.Column("draft_tokens", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("draft_accepted", sa.Integer(), nullable=True))


def downgrade() -> None:
    """Drop the columns and the check."""
    with op.batch_alter_table("requests") as batch:
        batch.drop_column("draft_accepted")
        batch.drop_column("draft_tokens")
    with op.batch_alter_table("request_classes") as batch:
        batch.drop_column("speculation")
    with op.batch_alter_table("runner_settings") as batch:
        batch.drop_constraint(op.f("ck_runner_settings_speculation"), type_="check")
        batch.drop_column("speculation")
