"""A model's big-model settings: KV cache types (-ctk / -ctv), experts kept in RAM (--n-cpu-moe), and its GPUs
(--device, --tensor-split, --split-mode, --main-gpu)

Revision ID: 0020
Revises: 0018
Create Date: 2026-12-04
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0020"
# 0019 is another branch's, written beside this one; the merge chains them.
down_revision: str | Sequence[str] | None = "0019"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Add the runner_settings columns; NULL everywhere: what every model has today (f16, no overrides, all GPUs)."""
    with op.batch_alter_table("runner_settings") as batch:
        batch.add_column(sa.Column("cache_type_k", sa.String(16), nullable=True))
        batch.add_column(sa.Column("cache_type_v", sa.String(16), nullable=True))
        batch.add_column(sa.Column("n_cpu_moe", sa.Integer, nullable=True))
        batch.add_column(sa.Column("devices", sa.String(255), nullable=True))
        batch.add_column(sa.Column("tensor_split", sa.String(255), nullable=True))
        batch.add_column(sa.Column("split_mode", sa.String(8), nullable=True))
        batch.add_column(sa.Column("main_gpu", sa.Integer, nullable=True))


def downgrade() -> None:
    """Drop the columns."""
    with op.batch_alter_table("runner_settings") as batch:
        for column in ("main_gpu", "split_mode", "tensor_split", "devices", "n_cpu_moe"):
            batch.drop_column(column)
        batch.drop_column("cache_type_v")
        batch.drop_column("cache_type_k")
