"""Members' own limits and the people behind trusted tokens, a manage permission per token, refusals counted

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-08
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0011"
down_revision: str | Sequence[str] | None = "0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

LIMITS = ("max_concurrent", "max_queue", "max_requests_per_min", "max_tokens_per_min", "max_tokens_per_day")


def upgrade() -> None:
    """Add the members' limits, parent and external id; the tokens' may_manage and trust_user_headers
    (both off: no existing token gains a permission); the refusals table."""
    with op.batch_alter_table("members") as batch:
        batch.add_column(sa.Column("parent_id", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("external_id", sa.String(128), nullable=True))
        for name in LIMITS:
            batch.add_column(sa.Column(name, sa.Integer(), nullable=True))
        batch.create_foreign_key("fk_members_parent_id_members", "members", ["parent_id"], ["id"], ondelete="CASCADE")
        batch.create_unique_constraint("uq_members_parent_id_external_id", ["parent_id", "external_id"])
        batch.create_index("ix_members_parent_id", ["parent_id"])
    with op.batch_alter_table("api_tokens") as batch:
        batch.add_column(sa.Column("may_manage", sa.Boolean(), nullable=False, server_default=sa.text("0")))
        batch.add_column(sa.Column("trust_user_headers", sa.Boolean(), nullable=False, server_default=sa.text("0")))
    # WITHOUT ROWID: the (bucket, member, class, reason) key is the table; a minute of a flood is one row.
    op.create_table(
        "refusals",
        sa.Column("bucket", sa.Integer(), nullable=False),
        sa.Column("member_name", sa.String(128), nullable=False),
        sa.Column("class_name", sa.String(64), nullable=False),
        sa.Column("reason", sa.String(32), nullable=False),
        sa.Column("count", sa.Integer(), nullable=False),
        sa.PrimaryKeyConstraint("bucket", "member_name", "class_name", "reason", name="pk_refusals"),
        sqlite_with_rowid=False,
    )


def downgrade() -> None:
    """Drop the refusals table and the columns 0011 added (the people behind trusted tokens go with them)."""
    op.drop_table("refusals")
    with op.batch_alter_table("api_tokens") as batch:
        batch.drop_column("trust_user_headers")
        batch.drop_column("may_manage")
    # Their tokens belong to the member above them; without parent_id they would pass for members of their own.
    op.execute("DELETE FROM members WHERE parent_id IS NOT NULL")
    with op.batch_alter_table("members") as batch:
        batch.drop_index("ix_members_parent_id")
        batch.drop_constraint("uq_members_parent_id_external_id", type_="unique")
        batch.drop_constraint("fk_members_parent_id_members", type_="foreignkey")
        for name in (*reversed(LIMITS), "external_id", "parent_id"):
            batch.drop_column(name)
