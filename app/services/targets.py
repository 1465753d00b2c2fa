"""A new store's TPOT targets sized from the first measured costs, not fixed numbers.

The shipped classes' targets (app/store/seed.py) are numbers from one machine. Once the household's default
model has measured its chunk costs (its runner reports a measured knee), every class whose TPOT target is still
the shipped value and tighter than the pace a full batch keeps on this hardware is raised to that pace (rounded
up to two figures): keeping a target the hardware cannot reach only holds prompts back, and the Classes page's
SLO figures would read as failures of the box. It happens once per store, is recorded in the store's settings
(when, from which model, what changed), and an admin's own target is never touched. Later advice comes from
the bench's verdict, applied by the admin.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from app.services.settings import SettingsCache
from app.store.models import RequestClass, Setting, utcnow
from app.store.seed import DEFAULT_CLASSES
from app.telemetry.feasibility import hardware_of, round_up

log = logging.getLogger("hearth.targets")

SIZED_KEY = "targets.sized_from_hardware"  # the record of the one sizing: {at, model, figures, changes}
SHIPPED_TPOT = {c["name"]: c["tpot_target_ms"] for c in DEFAULT_CLASSES}


def size_classes(session: Session, model: str, full_batch_tpot_ms: float, knee: int) -> dict[str, list[int]]:
    """Raise shipped TPOT targets below the full batch's pace to it; returns {class: [before, after]} (uncommitted)."""
    pace = round_up(full_batch_tpot_ms)
    changes = {}
    for row in session.scalars(select(RequestClass).order_by(RequestClass.name)):
        if SHIPPED_TPOT.get(row.name) == row.tpot_target_ms and row.tpot_target_ms < full_batch_tpot_ms:
            changes[row.name] = [row.tpot_target_ms, pace]
            row.tpot_target_ms = pace
    session.merge(Setting(key=SIZED_KEY, value={
        "at": utcnow().isoformat(timespec="seconds"), "model": model,
        "full_batch_tpot_ms": round(full_batch_tpot_ms, 1), "knee_tokens": knee, "changes": changes},
        updated_at=utcnow()))
    return changes


class TargetSizer:
    """The serve job that sizes a new store's targets once its default model's costs are measured."""

    def __init__(self, sessions: sessionmaker, settings: SettingsCache, latest: Callable[[], dict],
                 default_model: Callable[[], str | None], slots_of: Callable[[str], int | None],
                 on_change: Callable[[], None]):
        self.sessions = sessions
        self.settings = settings
        self.latest = latest
        self.default_model = default_model
        self.slots_of = slots_of
        self.on_change = on_change
        self.done = False

    def run(self) -> dict[str, list[int]] | None:
        """Size the targets if it is time (once per store); returns the changes made, or None."""
        if self.done or not self.settings.get("size_targets_from_hardware"):
            return None
        model = self.default_model()
        hw = hardware_of(self.latest(), model, self.slots_of(model)) if model else None
        if hw is None or not hw.measured:
            return None
        with self.sessions() as s:
            if s.get(Setting, SIZED_KEY) is not None:
                self.done = True
                return None
            changes = size_classes(s, model, hw.full_batch_tpot_ms, hw.knee_tokens)
            s.commit()
        self.done = True
        self.on_change()
        if changes:
            log.info("class TPOT targets sized from %s's measured costs (a full batch keeps %.0f ms a token): %s",
                     model, hw.full_batch_tpot_ms, ", ".join(f"{n} {a} → {b} ms" for n, (a, b) in changes.items()))
        return changes
