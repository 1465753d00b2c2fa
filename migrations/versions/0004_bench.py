"""Bench: sessions, runs, raw per-request evidence, applied recommendations

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-29
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | Sequence[str] | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Create bench_sessions, bench_runs, bench_requests and bench_applied."""
    op.create_table(
        "bench_sessions",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("started_at", sa.DateTime(), nullable=False),
        sa.Column("finished_at", sa.DateTime(), nullable=True),
        sa.Column("scenario", sa.String(128), nullable=False),
        sa.Column("status", sa.String(16), server_default="running", nullable=False),
        sa.Column("model_name", sa.String(255), nullable=True),
        sa.Column("constants", sa.JSON(), server_default="{}", nullable=False),
        sa.Column("verdict", sa.JSON(), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_bench_sessions"),
    )
    op.create_index("ix_bench_sessions_started_at", "bench_sessions", ["started_at"])
    op.create_table(
        "bench_runs",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("session_id", sa.Integer(), nullable=False),
        sa.Column("target", sa.String(64), nullable=False),
        sa.Column("mode", sa.String(32), nullable=False),
        sa.Column("level", sa.Integer(), nullable=False),
        sa.Column("started_at", sa.DateTime(), nullable=False),
        sa.Column("wall_s", sa.Float(), nullable=False),
        sa.Column("samples", sa.JSON(), server_default="[]", nullable=False),
        sa.Column("summary", sa.JSON(), server_default="{}", nullable=False),
        sa.ForeignKeyConstraint(["session_id"], ["bench_sessions.id"], name="fk_bench_runs_session_id_bench_sessions",
                                ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name="pk_bench_runs"),
    )
    op.create_index("ix_bench_runs_session_id", "bench_runs", ["session_id"])
    op.create_table(
        "bench_requests",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("idx", sa.Integer(), nullable=False),
        sa.Column("class_name", sa.String(64), nullable=False),
        sa.Column("priority", sa.Integer(), nullable=False),
        sa.Column("sent_s", sa.Float(), nullable=False),
        sa.Column("first_token_s", sa.Float(), nullable=True),
        sa.Column("end_s", sa.Float(), nullable=True),
        sa.Column("prompt_tokens", sa.Integer(), nullable=True),
        sa.Column("completion_tokens", sa.Integer(), nullable=True),
        sa.Column("max_tokens", sa.Integer(), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("server_timings", sa.JSON(), nullable=True),
        sa.ForeignKeyConstraint(["run_id"], ["bench_runs.id"], name="fk_bench_requests_run_id_bench_runs",
                                ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name="pk_bench_requests"),
    )
    op.create_index("ix_bench_requests_run_id", "bench_requests", ["run_id"])
    op.create_table(
        "bench_applied",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("at", sa.DateTime(), nullable=False),
        sa.Column("applied_by", sa.String(128), nullable=False),
        sa.Column("session_id", sa.Integer(), nullable=True),
        sa.Column("model_name", sa.String(255), nullable=False),
        sa.Column("recommendation", sa.JSON(), nullable=False),
        sa.Column("changes", sa.JSON(), nullable=False),
        sa.ForeignKeyConstraint(["session_id"], ["bench_sessions.id"],
                                name="fk_bench_applied_session_id_bench_sessions", ondelete="SET NULL"),
        sa.PrimaryKeyConstraint("id", name="pk_bench_applied"),
    )
    op.create_index("ix_bench_applied_at", "bench_applied", ["at"])


def downgrade() -> None:
    """Drop the bench tables."""
    for name in ("bench_applied", "bench_requests", "bench_runs", "bench_sessions"):
        op.drop_table(name)
