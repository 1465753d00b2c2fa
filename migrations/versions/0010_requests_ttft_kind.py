"""What each request row's TTFT measured: rows before this revision are marked with the wrong kind

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-01
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0010"
down_revision: str | Sequence[str] | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# 0006's ix_requests_latency, plus ttft_kind last: the TTFT charts and SLO figures filter on it and
# still read the index alone.
BEFORE = ["arrival_at", "status", "class_name", "ttft_ms", "tpot_ms", "queue_ms", "completion_tokens"]
AFTER = [*BEFORE, "ttft_kind"]


def upgrade() -> None:
    """Add requests.ttft_kind; the rows already logged measured the first byte (streamed) or the runner's TTFT."""
    with op.batch_alter_table("requests") as batch:
        batch.add_column(sa.Column("ttft_kind", sa.String(16), nullable=True))
    # Written out, not imported from app.store.models: a migration must not change with the code.
    op.execute("UPDATE requests SET ttft_kind = CASE WHEN stream THEN 'first_byte' ELSE 'runner' END "
               "WHERE ttft_ms IS NOT NULL")
    op.drop_index("ix_requests_latency", "requests")
    op.create_index("ix_requests_latency", "requests", AFTER)


def downgrade() -> None:
    """Drop requests.ttft_kind (and it from ix_requests_latency)."""
    op.drop_index("ix_requests_latency", "requests")
    op.create_index("ix_requests_latency", "requests", BEFORE)
    with op.batch_alter_table("requests") as batch:
        batch.drop_column("ttft_kind")
