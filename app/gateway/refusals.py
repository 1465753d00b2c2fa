"""Refused requests counted, not logged one row each: per minute, member, class and reason.

A runaway script can send thousands of requests a minute that are all refused at admission (429).
Each used to be a row of the request log; now each increments a counter here (and /metrics), and
the `flush_refusals` job adds the counters to the store's `refusals` table, one upsert per
(minute, member, class, reason). So a flood of any size grows the store by a handful of rows a
minute, and the Members page still shows who was refused, where and why.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from sqlalchemy import func, select, text
from sqlalchemy.orm import Session

from app.store.models import Refusal
from app.store.writer import StoreWriter

MINUTE_S = 60
# Why a request was refused at admission: the class's queue was full, the member held their whole
# share of it, the member reached one of their rate limits (app.gateway.members), or the request's
# `n` choices need more places than its member or class may ever hold.
REFUSAL_REASONS = ("class_queue_full", "member_queue_full", "max_requests_per_min", "max_tokens_per_min",
                   "max_tokens_per_day", "too_many_choices")

_UPSERT = text("INSERT INTO refusals (bucket, member_name, class_name, reason, count) "
               "VALUES (:bucket, :member, :klass, :reason, :n) "
               "ON CONFLICT (bucket, member_name, class_name, reason) DO UPDATE SET count = count + excluded.count")


class Refusals:
    """In-memory refusal counters, flushed to the store by the `flush_refusals` job (and at shutdown)."""

    def __init__(self, writer: StoreWriter, observe: Callable[[dict], None] = lambda values: None,
                 clock: Callable[[], float] = time.time):
        self._writer = writer
        self._observe = observe
        self.clock = clock
        self._lock = threading.Lock()
        self._pending: dict[tuple[int, str, str, str], int] = {}

    def count(self, member: str, class_name: str, reason: str) -> None:
        """Count one refused request (never blocks serving, never writes a row of its own)."""
        if reason not in REFUSAL_REASONS:
            raise ValueError(f"unknown refusal reason {reason!r}; known: {', '.join(REFUSAL_REASONS)}")
        bucket = int(self.clock()) // MINUTE_S * MINUTE_S
        key = (bucket, member, class_name, reason)
        with self._lock:
            self._pending[key] = self._pending.get(key, 0) + 1
        self._observe({"class_name": class_name, "status": "rejected", "refusal_reason": reason})

    def pending(self) -> dict[tuple[int, str, str, str], int]:
        """The counts not yet in the store: (minute, member, class, reason) → refused requests."""
        with self._lock:
            return dict(self._pending)

    def flush(self) -> int:
        """The `flush_refusals` job: queue the counts on the store writer as one upsert batch; how many keys."""
        with self._lock:
            pending, self._pending = self._pending, {}
        if not pending:
            return 0
        params = [{"bucket": b, "member": m, "klass": c, "reason": r, "n": n} for (b, m, c, r), n in pending.items()]

        def write(session: Session) -> None:
            session.execute(_UPSERT, params)

        if not self._writer.submit(write):
            # The writer refused it (queue full or stopped): keep the counts for the next flush.
            with self._lock:
                for key, n in pending.items():
                    self._pending[key] = self._pending.get(key, 0) + n
        return len(pending)

    def recent(self, session: Session, since_s: float) -> dict[str, dict[str, int]]:
        """Per member: refusals by reason since `since_s` (Unix seconds), stored and not yet stored."""
        out: dict[str, dict[str, int]] = {}
        since_bucket = int(since_s) // MINUTE_S * MINUTE_S
        rows = session.execute(
            select(Refusal.member_name, Refusal.reason, func.sum(Refusal.count))
            .where(Refusal.bucket >= since_bucket).group_by(Refusal.member_name, Refusal.reason))
        for member, reason, n in rows:
            out.setdefault(member, {})[reason] = int(n)
        for (bucket, member, _klass, reason), n in self.pending().items():
            if bucket >= since_bucket:
                by_reason = out.setdefault(member, {})
                by_reason[reason] = by_reason.get(reason, 0) + n
        return out

