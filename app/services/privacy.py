"""What serve does so a family's words do not outlive their purpose on disk: the KV disk tier's maximum age
(an hourly job, for models no runner serves now: a running one expires its own entries) and a member's removal
(their tokens, the people behind them, their request-log text and their KV disk-tier entries)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy import delete, select, update
from sqlalchemy.orm import Session

from app.engine.kv_tiers import expire_entries, remove_owner_entries
from app.paths import KV_CACHE_DIR
from app.store.models import Member, Refusal, RequestRecord

log = logging.getLogger(__name__)

MAX_AGE_SETTING = "runner_cache_disk_max_age_h"
# The owner app.gateway.pipeline gives tokenless LAN requests (LAN_MEMBER; no row of the store).
LAN_OWNER = "lan"


def expire_kv_cache(data_dir: Path, max_age_h: Callable[[], float], clock: Callable[[], float] = time.time) -> int:
    """Delete the KV disk tier's entries no request used for the max age (0: never); returns how many."""
    hours = float(max_age_h() or 0)
    if hours <= 0:
        return 0
    removed = expire_entries(Path(data_dir) / KV_CACHE_DIR, hours * 3600, clock())
    if removed:
        log.info("KV disk tier: %d cached prefixes unused for %g h deleted", removed, hours)
    return removed


def remove_orphans(data_dir: Path, members: set[str]) -> int:
    """Delete the KV disk-tier entries of members the store no longer has; returns how many.

    A running runner may write a removed member's prefix after the removal (a request of theirs still in flight,
    a copy it held in memory): serve's hourly job catches those."""
    removed = remove_owner_entries(Path(data_dir) / KV_CACHE_DIR, lambda owner: owner not in members
                                   and owner != LAN_OWNER)
    if removed:
        log.info("KV disk tier: %d cached prefixes of removed members deleted", removed)
    return removed


class MemberNotFound(LookupError):
    """No member of that name."""


@dataclass(frozen=True)
class Removal:
    """What removing a member took away."""

    names: tuple[str, ...]  # the member and the people behind their trusted tokens
    requests_cleared: int  # request-log rows whose member name and error text were cleared
    kv_entries: int  # KV disk-tier files deleted


def remove_member(session: Session, data_dir: Path, name: str) -> Removal:
    """Remove a member, the people behind their tokens, their tokens, their request-log text and KV disk entries.

    The request log keeps the rows' counts and timings (the household's figures stay true) without the name or the
    error text; refusal counts under their names go. The caller commits nothing: this commits."""
    row = session.scalar(select(Member).where(Member.name == name))
    if row is None:
        raise MemberNotFound(f"no member '{name}'")
    ids, names = {row.id}, [row.name]
    frontier = [row.id]
    while frontier:  # the people behind the member's trusted tokens, and theirs
        children = session.execute(select(Member.id, Member.name).where(Member.parent_id.in_(frontier))).all()
        frontier = [c.id for c in children if c.id not in ids]
        ids.update(frontier)
        names += [c.name for c in children]
    cleared = session.execute(update(RequestRecord).where(RequestRecord.member_name.in_(names))
                              .values(member_name=None, error=None)).rowcount
    session.execute(delete(Refusal).where(Refusal.member_name.in_(names)))
    session.execute(delete(Member).where(Member.id == row.id))  # tokens and people go with it (ON DELETE CASCADE)
    session.commit()
    gone = set(names)
    kv = remove_owner_entries(Path(data_dir) / KV_CACHE_DIR, gone.__contains__)
    log.info("member %s removed: %d people behind their tokens, %d request-log rows cleared, %d KV disk entries "
             "deleted", name, len(names) - 1, cleared, kv)
    return Removal(tuple(names), cleared, kv)
