"""Default rows a new store starts with: the five request classes."""

from __future__ import annotations

from typing import Any

from sqlalchemy import select
from sqlalchemy.dialects.sqlite import insert
from sqlalchemy.orm import Session

from app.store.models import RequestClass, Setting, utcnow

# Voice does not think (thinking "off"): Home Assistant speaks the answer, and a reasoning model's thoughts
# would cost the household seconds of silence before it; the other classes leave it to the model.
# Lower priority number = served first. Tokens are output tokens. max_concurrent is a gateway cap: the
# engine itself serves the urgent classes first and preempts the preemptible ones for them (their cells
# stay cached), so the preemptible classes may fill half of a sized runner's 8 slots rather than idle
# them, and voice (short answers, served first) is not held behind its own class's earlier requests.
DEFAULT_CLASSES: tuple[dict[str, Any], ...] = (
    dict(name="voice", priority=0, ttft_target_ms=500, tpot_target_ms=100, default_max_tokens=128,
         max_output_tokens=256, max_concurrent=8, max_queue=16, weight=4.0, preemptible=False,
         queue_timeout_s=10.0, thinking="off"),
    dict(name="chat", priority=1, ttft_target_ms=1500, tpot_target_ms=150, default_max_tokens=512,
         max_output_tokens=2048, max_concurrent=4, max_queue=32, weight=3.0, preemptible=False,
         queue_timeout_s=60.0, thinking="model"),
    dict(name="documents", priority=2, ttft_target_ms=5000, tpot_target_ms=200, default_max_tokens=512,
         max_output_tokens=2048, max_concurrent=4, max_queue=32, weight=2.0, preemptible=True,
         queue_timeout_s=120.0, thinking="model"),
    dict(name="coding", priority=1, ttft_target_ms=2000, tpot_target_ms=150, default_max_tokens=1024,
         max_output_tokens=4096, max_concurrent=2, max_queue=16, weight=2.0, preemptible=False,
         queue_timeout_s=120.0, thinking="model"),
    dict(name="background", priority=3, ttft_target_ms=30000, tpot_target_ms=500, default_max_tokens=512,
         max_output_tokens=4096, max_concurrent=4, max_queue=256, weight=1.0, preemptible=True,
         queue_timeout_s=600.0, thinking="model"),
)

# The default classes ever seeded into this store: one an admin deleted stays deleted.
SEEDED_CLASSES_KEY = "seed.request_classes"


def seed_defaults(session: Session) -> list[str]:
    """Insert the default classes this store never had; returns their names. The caller commits."""
    existing = set(session.scalars(select(RequestClass.name)))
    seeded_setting = session.get(Setting, SEEDED_CLASSES_KEY)
    seeded = set(seeded_setting.value) if seeded_setting is not None else set()
    missing = [row for row in DEFAULT_CLASSES if row["name"] not in existing | seeded]
    if missing:
        # DO NOTHING on conflict: a class created meanwhile by someone else is theirs, never overwritten.
        session.execute(insert(RequestClass).values(missing).on_conflict_do_nothing(index_elements=["name"]))
    names = sorted(seeded | {row["name"] for row in DEFAULT_CLASSES})
    if seeded_setting is None:
        session.add(Setting(key=SEEDED_CLASSES_KEY, value=names, updated_at=utcnow()))
    elif names != sorted(seeded_setting.value):
        seeded_setting.value = names
    return [row["name"] for row in missing]
