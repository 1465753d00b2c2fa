"""Telemetry rollups, retention and range queries over the 1-second samples; retention of the request log.

Samples are rolled into 1-minute buckets once a minute is complete, and minute rows into 1-hour
buckets once an hour is; readers of long ranges use the rollups. Every function here takes `now`
from its caller, so tests choose the time. Times in these tables are integer Unix seconds.
The request log (and the per-minute refusal counts beside it) is kept `requests_retention_days`.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime, timedelta

from sqlalchemy import delete, select, text
from sqlalchemy.orm import Session

from app.store.models import RequestRecord, Series, utcnow
from app.store.writer import StoreWriter

MINUTE_S = 60
HOUR_S = 3600
# A bucket is rolled up only this long after it ends: samples reach the store through the writer's
# queue, and one that arrives after its minute was rolled up would be left out of it.
GRACE_S = 5
# How long rollups are kept: minute rows serve ranges up to 48 h (and a month of history), hourly
# rows a year. About 26 MB and 5 MB at 22 series (see the size math in models.py).
MINUTE_RETENTION = timedelta(days=30)
HOUR_RETENTION = timedelta(days=365)
# Request rows deleted per prune pass: one writer transaction stays short even when a lowered
# retention leaves a year of rows to delete; the hourly job takes the rest in later passes.
MAX_PRUNED_REQUESTS = 50_000
# series() reads raw samples up to 1 h (3600 points), minute rows up to 48 h (2880), hourly beyond.
RAW_MAX_RANGE = timedelta(hours=1)
MINUTE_MAX_RANGE = timedelta(hours=48)

# (source table, time column, target table, bucket width, aggregate columns) per rollup level.
_LEVELS = [
    ("samples", "at", "rollups_1m", MINUTE_S, "min(value), max(value), sum(value), count(*)"),
    ("rollups_1m", "bucket", "rollups_1h", HOUR_S, "min(min), max(max), sum(sum), sum(count)"),
]


def to_unix(t: datetime) -> int:
    """Unix seconds of an aware datetime (naive ones are refused: their zone is unknown)."""
    if t.tzinfo is None or t.utcoffset() is None:
        raise ValueError(f"naive datetime {t!r}: pass an aware one")
    return int(t.timestamp())


def from_unix(seconds: int) -> datetime:
    """The aware UTC datetime of Unix seconds."""
    return datetime.fromtimestamp(seconds, UTC)


def _series_ids(session: Session) -> list[int]:
    return list(session.scalars(select(Series.id)))


def rollup(session: Session, now: datetime) -> dict[str, int]:
    """Roll complete minutes of samples into rollups_1m, then complete hours into rollups_1h; idempotent."""
    done_s = to_unix(now) - GRACE_S
    written = {}
    for source, time_col, target, width, aggregates in _LEVELS:
        end = done_s // width * width
        written[target] = 0
        for series_id in _series_ids(session):
            # Per series, from just after its newest bucket: a range read on the (series_id, time)
            # key, and a series that appears later still gets its whole history rolled up.
            last = session.execute(
                text(f"SELECT max(bucket) FROM {target} WHERE series_id = :s"), {"s": series_id}
            ).scalar()
            if last is None:
                first = session.execute(
                    text(f"SELECT min({time_col}) FROM {source} WHERE series_id = :s"), {"s": series_id}
                ).scalar()
                if first is None:
                    continue
                start = first // width * width
            else:
                start = last + width
            if start >= end:
                continue
            # OR IGNORE as well as the watermark: a bucket is written once and never changes.
            result = session.execute(
                text(
                    f"INSERT OR IGNORE INTO {target} (series_id, bucket, min, max, sum, count)"
                    f" SELECT series_id, ({time_col} / {width}) * {width} AS b, {aggregates}"
                    f" FROM {source} WHERE series_id = :s AND {time_col} >= :lo AND {time_col} < :hi"
                    " GROUP BY series_id, b"
                ),
                {"s": series_id, "lo": start, "hi": end},
            )
            written[target] += result.rowcount
    return written


def prune(session: Session, now: datetime, retention: timedelta | None = None) -> dict[str, int]:
    """Delete samples older than `retention` (default: the samples_retention_h setting) and expired rollups."""
    if retention is None:
        from app.store.settings import get_setting

        retention = timedelta(hours=float(get_setting(session, "samples_retention_h")))
    cutoffs = [
        ("samples", "at", now - retention),
        ("rollups_1m", "bucket", now - MINUTE_RETENTION),
        ("rollups_1h", "bucket", now - HOUR_RETENTION),
    ]
    deleted = {}
    ids = _series_ids(session)
    for table, time_col, cutoff in cutoffs:
        deleted[table] = 0
        # Per series so each delete is a range on the primary key rather than a scan of the table.
        for series_id in ids:
            result = session.execute(
                text(f"DELETE FROM {table} WHERE series_id = :s AND {time_col} < :cutoff"),
                {"s": series_id, "cutoff": to_unix(cutoff)},
            )
            deleted[table] += result.rowcount
    return deleted


def prune_requests(session: Session, now: datetime, retention: timedelta | None = None) -> dict[str, int]:
    """Delete request rows and refusal counts older than `retention` (default: requests_retention_days)."""
    if retention is None:
        from app.store.settings import get_setting

        retention = timedelta(days=float(get_setting(session, "requests_retention_days")))
    cutoff = now - retention
    # By id through the arrival_at index, at most MAX_PRUNED_REQUESTS a pass (SQLite has no DELETE … LIMIT).
    old = select(RequestRecord.id).where(RequestRecord.arrival_at < cutoff).limit(MAX_PRUNED_REQUESTS)
    requests = session.execute(delete(RequestRecord).where(RequestRecord.id.in_(old))).rowcount
    refusals = session.execute(text("DELETE FROM refusals WHERE bucket < :cutoff"),
                               {"cutoff": to_unix(cutoff)}).rowcount
    return {"requests": requests, "refusals": refusals}


def resolution(start: datetime, end: datetime) -> str:
    """Which table series() reads for this range: 'samples', 'rollups_1m' or 'rollups_1h'."""
    span = end - start
    if span <= RAW_MAX_RANGE:
        return "samples"
    if span <= MINUTE_MAX_RANGE:
        return "rollups_1m"
    return "rollups_1h"


def series(session: Session, source: str, metric: str, start: datetime, end: datetime) -> list[tuple[datetime, float]]:
    """Points (t, value) of one series in [start, end]: raw samples, or bucket means for longer ranges."""
    series_id = session.scalar(select(Series.id).where(Series.source == source, Series.metric == metric))
    if series_id is None:
        return []
    table = resolution(start, end)
    lo, hi = to_unix(start), to_unix(end)
    if table == "samples":
        sql = "SELECT at, value FROM samples WHERE series_id = :s AND at >= :lo AND at <= :hi ORDER BY at"
    else:
        width = MINUTE_S if table == "rollups_1m" else HOUR_S
        # Include the bucket that holds `start`: its mean covers part of the range.
        lo = lo // width * width
        sql = (f"SELECT bucket, sum / count FROM {table}"
               " WHERE series_id = :s AND bucket >= :lo AND bucket <= :hi ORDER BY bucket")
    rows = session.execute(text(sql), {"s": series_id, "lo": lo, "hi": hi})
    return [(from_unix(t), float(v)) for t, v in rows]


class Rollups:
    """The `rollup_samples`, `prune_samples` and `prune_requests` jobs: each queues one pass on the store writer."""

    def __init__(self, writer: StoreWriter, clock: Callable[[], datetime] = utcnow):
        self.writer = writer
        self.clock = clock

    def rollup_samples(self) -> None:
        """Queue a rollup up to now on the store writer."""
        now = self.clock()
        self.writer.submit(lambda session: rollup(session, now))

    def prune_samples(self) -> None:
        """Queue the retention pass on the store writer."""
        now = self.clock()
        self.writer.submit(lambda session: prune(session, now))

    def prune_requests(self) -> None:
        """Queue the request log's retention pass on the store writer."""
        now = self.clock()
        self.writer.submit(lambda session: prune_requests(session, now))
