"""Initial schema: models, runner settings, residency events, classes, members, tokens, requests, settings

Revision ID: 0001
Revises:
Create Date: 2025-01-01
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | Sequence[str] | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Create the first tables."""
    op.create_table(
        "models",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(255), nullable=False),
        sa.Column("path", sa.Text(), nullable=True),
        sa.Column("source", sa.String(16), nullable=False),
        sa.Column("size_bytes", sa.BigInteger(), nullable=True),
        sa.Column("architecture", sa.String(64), nullable=True),
        sa.Column("n_params", sa.BigInteger(), nullable=True),
        sa.Column("quantization", sa.String(32), nullable=True),
        sa.Column("n_ctx_train", sa.Integer(), nullable=True),
        sa.Column("n_layers", sa.Integer(), nullable=True),
        sa.Column("n_head_kv", sa.Integer(), nullable=True),
        sa.Column("head_dim_k", sa.Integer(), nullable=True),
        sa.Column("head_dim_v", sa.Integer(), nullable=True),
        sa.Column("has_chat_template", sa.Boolean(), server_default=sa.text("0"), nullable=False),
        sa.Column("usable", sa.Boolean(), server_default=sa.text("1"), nullable=False),
        sa.Column("unusable_reason", sa.Text(), nullable=True),
        sa.Column("policy", sa.String(16), server_default="keep_alive", nullable=False),
        sa.Column("keep_alive_s", sa.Integer(), server_default=sa.text("300"), nullable=False),
        sa.Column("alias", sa.String(255), nullable=True),
        sa.Column("first_seen_at", sa.DateTime(), nullable=False),
        sa.Column("last_seen_at", sa.DateTime(), nullable=False),
        sa.CheckConstraint("source IN ('default', 'folder', 'remote')", name="ck_models_source"),
        sa.CheckConstraint("policy IN ('on_demand', 'pinned', 'keep_alive')", name="ck_models_policy"),
        sa.PrimaryKeyConstraint("id", name="pk_models"),
        sa.UniqueConstraint("name", name="uq_models_name"),
        sa.UniqueConstraint("alias", name="uq_models_alias"),
    )
    op.create_table(
        "runner_settings",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("model_id", sa.Integer(), nullable=False),
        sa.Column("kind", sa.String(16), server_default="hearth", nullable=False),
        sa.Column("binary_path", sa.Text(), nullable=True),
        sa.Column("n_ctx", sa.Integer(), nullable=True),
        sa.Column("parallel", sa.Integer(), nullable=True),
        sa.Column("n_batch", sa.Integer(), nullable=True),
        sa.Column("threads", sa.Integer(), nullable=True),
        sa.Column("gpu_layers", sa.Integer(), nullable=True),
        sa.Column("mode", sa.String(16), nullable=True),
        sa.CheckConstraint("kind IN ('hearth', 'llama-server')", name="ck_runner_settings_kind"),
        sa.CheckConstraint(
            "mode IS NULL OR mode IN ('continuous', 'serial', 'static')", name="ck_runner_settings_mode"
        ),
        sa.ForeignKeyConstraint(
            ["model_id"], ["models.id"], name="fk_runner_settings_model_id_models", ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name="pk_runner_settings"),
        sa.UniqueConstraint("model_id", name="uq_runner_settings_model_id"),
    )
    op.create_table(
        "residency_events",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("at", sa.DateTime(), nullable=False),
        sa.Column("model_name", sa.String(255), nullable=False),
        sa.Column("node", sa.Text(), nullable=True),
        sa.Column("event", sa.String(16), nullable=False),
        sa.Column("reason", sa.Text(), nullable=True),
        sa.Column("cold_start_ms", sa.Float(), nullable=True),
        sa.Column("estimate_bytes", sa.BigInteger(), nullable=True),
        sa.Column("measured_bytes", sa.BigInteger(), nullable=True),
        sa.Column("pid", sa.Integer(), nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_residency_events"),
    )
    op.create_index("ix_residency_events_at", "residency_events", ["at"])
    op.create_table(
        "request_classes",
        sa.Column("name", sa.String(64), nullable=False),
        sa.Column("priority", sa.Integer(), nullable=False),
        sa.Column("ttft_target_ms", sa.Integer(), nullable=False),
        sa.Column("tpot_target_ms", sa.Integer(), nullable=False),
        sa.Column("default_max_tokens", sa.Integer(), nullable=False),
        sa.Column("max_output_tokens", sa.Integer(), nullable=False),
        sa.Column("max_concurrent", sa.Integer(), nullable=False),
        sa.Column("max_queue", sa.Integer(), nullable=False),
        sa.Column("weight", sa.Float(), nullable=False),
        sa.Column("preemptible", sa.Boolean(), nullable=False),
        sa.Column("queue_timeout_s", sa.Float(), nullable=False),
        sa.Column("default_model", sa.String(255), nullable=True),
        sa.PrimaryKeyConstraint("name", name="pk_request_classes"),
    )
    op.create_table(
        "members",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(128), nullable=False),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_members"),
        sa.UniqueConstraint("name", name="uq_members_name"),
    )
    op.create_table(
        "api_tokens",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("member_id", sa.Integer(), nullable=False),
        sa.Column("prefix", sa.String(12), nullable=False),
        sa.Column("token_hash", sa.String(64), nullable=False),
        sa.Column("default_class", sa.String(64), nullable=False),
        sa.Column("allowed_classes", sa.JSON(), server_default="[]", nullable=False),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.Column("revoked_at", sa.DateTime(), nullable=True),
        sa.Column("last_used_at", sa.DateTime(), nullable=True),
        sa.ForeignKeyConstraint(
            ["member_id"], ["members.id"], name="fk_api_tokens_member_id_members", ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name="pk_api_tokens"),
        sa.UniqueConstraint("token_hash", name="uq_api_tokens_token_hash"),
    )
    op.create_index("ix_api_tokens_member_id", "api_tokens", ["member_id"])
    op.create_table(
        "requests",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("arrival_at", sa.DateTime(), nullable=False),
        sa.Column("member_name", sa.String(128), nullable=True),
        sa.Column("token_id", sa.Integer(), nullable=True),
        sa.Column("class_name", sa.String(64), nullable=True),
        sa.Column("model", sa.String(255), nullable=True),
        sa.Column("runner", sa.Text(), nullable=True),
        sa.Column("stream", sa.Boolean(), server_default=sa.text("0"), nullable=False),
        sa.Column("prompt_tokens", sa.Integer(), nullable=True),
        sa.Column("completion_tokens", sa.Integer(), nullable=True),
        sa.Column("queue_ms", sa.Float(), nullable=True),
        sa.Column("ttft_ms", sa.Float(), nullable=True),
        sa.Column("tpot_ms", sa.Float(), nullable=True),
        sa.Column("total_ms", sa.Float(), nullable=True),
        sa.Column("num_preemptions", sa.Integer(), server_default=sa.text("0"), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("http_status", sa.Integer(), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_requests"),
    )
    op.create_index("ix_requests_arrival_at", "requests", ["arrival_at"])
    op.create_index("ix_requests_class_name_arrival_at", "requests", ["class_name", "arrival_at"])
    op.create_table(
        "settings",
        sa.Column("key", sa.String(128), nullable=False),
        sa.Column("value", sa.JSON(), nullable=False),
        sa.Column("updated_at", sa.DateTime(), nullable=False),
        sa.PrimaryKeyConstraint("key", name="pk_settings"),
    )


def downgrade() -> None:
    """Drop every table."""
    op.drop_table("settings")
    op.drop_index("ix_requests_class_name_arrival_at", table_name="requests")
    op.drop_index("ix_requests_arrival_at", table_name="requests")
    op.drop_table("requests")
    op.drop_index("ix_api_tokens_member_id", table_name="api_tokens")
    op.drop_table("api_tokens")
    op.drop_table("members")
    op.drop_table("request_classes")
    op.drop_index("ix_residency_events_at", table_name="residency_events")
    op.drop_table("residency_events")
    op.drop_table("runner_settings")
    op.drop_table("models")
