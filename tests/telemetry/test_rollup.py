"""Rollups, retention, range queries and the 0003 migration, on real SQLite with chosen times."""

from datetime import UTC, datetime, timedelta

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import func, inspect, select, text

from app.store import db
from app.store.models import Base, Rollup1h, Rollup1m, Sample, Series
from app.store.settings import set_setting
from app.telemetry.rollup import (
    GRACE_S,
    from_unix,
    prune,
    resolution,
    rollup,
    series,
    to_unix,
)
from tests.helpers import store_points

T0 = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)  # on an hour boundary
U0 = to_unix(T0)


def put(sessions, source, metric, points):
    """Store (unix seconds, value) points of one series."""
    with sessions.begin() as s:
        store_points(s, source, metric, points)


def rows(sessions, model):
    with sessions() as s:
        return [(r.bucket, r.min, r.max, r.sum, r.count) for r in s.scalars(select(model).order_by(model.bucket))]


def run_rollup(sessions, now):
    with sessions.begin() as s:
        return rollup(s, now)


def test_minute_buckets_hold_min_max_sum_count_of_their_samples(sessions):
    # Minute 0: 1..60; minute 1: 10, 20, 30 at its first seconds; minute 2 is not over yet.
    put(sessions, "host", "cpu_pct", [(U0 + i, float(i + 1)) for i in range(60)])
    put(sessions, "host", "cpu_pct", [(U0 + 60, 10.0), (U0 + 61, 20.0), (U0 + 62, 30.0), (U0 + 125, 99.0)])
    run_rollup(sessions, T0 + timedelta(seconds=130))
    assert rows(sessions, Rollup1m) == [(U0, 1.0, 60.0, 1830.0, 60), (U0 + 60, 10.0, 30.0, 60.0, 3)]


def test_a_minute_is_rolled_up_only_after_the_grace_period(sessions):
    put(sessions, "host", "cpu_pct", [(U0, 1.0)])
    run_rollup(sessions, T0 + timedelta(seconds=60 + GRACE_S - 1))
    assert rows(sessions, Rollup1m) == []
    run_rollup(sessions, T0 + timedelta(seconds=60 + GRACE_S))
    assert rows(sessions, Rollup1m) == [(U0, 1.0, 1.0, 1.0, 1)]


def test_rollup_is_idempotent_and_picks_up_where_it_stopped(sessions):
    put(sessions, "host", "cpu_pct", [(U0 + i, 1.0) for i in range(0, 120, 10)])
    now = T0 + timedelta(seconds=70)
    assert run_rollup(sessions, now) == {"rollups_1m": 1, "rollups_1h": 0}
    before = rows(sessions, Rollup1m)
    assert run_rollup(sessions, now) == {"rollups_1m": 0, "rollups_1h": 0}
    assert rows(sessions, Rollup1m) == before
    # Later: the second minute completes; the first is not rewritten.
    assert run_rollup(sessions, T0 + timedelta(seconds=130)) == {"rollups_1m": 1, "rollups_1h": 0}
    assert rows(sessions, Rollup1m) == before + [(U0 + 60, 1.0, 1.0, 6.0, 6)]


def test_series_roll_up_separately_and_a_new_series_gets_its_history(sessions):
    put(sessions, "host", "cpu_pct", [(U0, 5.0)])
    run_rollup(sessions, T0 + timedelta(minutes=5))
    put(sessions, "gpu:0", "gpu_temp_c", [(U0 + 1, 60.0), (U0 + 200, 70.0)])
    run_rollup(sessions, T0 + timedelta(minutes=5))
    with sessions() as s:
        got = s.execute(select(Series.source, Rollup1m.bucket, Rollup1m.sum).join(Rollup1m)
                        .order_by(Series.source, Rollup1m.bucket)).all()
    assert got == [("gpu:0", U0, 60.0), ("gpu:0", U0 + 180, 70.0), ("host", U0, 5.0)]


def test_hour_buckets_are_built_from_minute_rows(sessions):
    # One sample every 30 s for two hours and a bit: value = the minute's index in the hour.
    points = [(U0 + k * 30, float((k // 2) % 60)) for k in range(2 * 120 + 10)]
    put(sessions, "host", "cpu_pct", points)
    run_rollup(sessions, T0 + timedelta(hours=2, minutes=2))
    hours = rows(sessions, Rollup1h)
    # Two complete hours; each: min 0, max 59, 120 samples summing to 2 * (0 + ... + 59).
    assert hours == [(U0, 0.0, 59.0, 3540.0, 120), (U0 + 3600, 0.0, 59.0, 3540.0, 120)]
    # Minutes 0 .. 120: the one ending at 2:02 is still inside its grace period.
    assert len(rows(sessions, Rollup1m)) == 121
    assert run_rollup(sessions, T0 + timedelta(hours=2, minutes=2)) == {"rollups_1m": 0, "rollups_1h": 0}


def test_rollup_refuses_a_naive_now(sessions):
    with sessions() as s, pytest.raises(ValueError):
        rollup(s, datetime(2026, 1, 1))


def count(sessions, model):
    with sessions() as s:
        return s.scalar(select(func.count()).select_from(model))


def test_prune_keeps_exactly_the_retention_window(sessions):
    now = T0 + timedelta(days=400)
    un = to_unix(now)
    retention = timedelta(hours=48)
    cutoff = un - int(retention.total_seconds())
    put(sessions, "host", "cpu_pct", [(cutoff - 1, 1.0), (cutoff, 2.0), (un, 3.0)])
    with sessions.begin() as s:
        sid = s.scalar(select(Series.id))
        for model, days in ((Rollup1m, 30), (Rollup1h, 365)):
            edge = un - days * 86400
            for bucket in (edge - 60, edge, un - 3600):
                s.add(model(series_id=sid, bucket=bucket, min=0, max=0, sum=0, count=1))
    with sessions.begin() as s:
        assert prune(s, now, retention) == {"samples": 1, "rollups_1m": 1, "rollups_1h": 1}
    with sessions() as s:
        assert list(s.scalars(select(Sample.at).order_by(Sample.at))) == [cutoff, un]
        assert s.scalar(select(func.min(Rollup1m.bucket))) == un - 30 * 86400
        assert s.scalar(select(func.min(Rollup1h.bucket))) == un - 365 * 86400
    with sessions.begin() as s:
        assert prune(s, now, retention) == {"samples": 0, "rollups_1m": 0, "rollups_1h": 0}


def test_prune_reads_the_retention_setting(sessions):
    now = T0 + timedelta(days=10)
    un = to_unix(now)
    put(sessions, "host", "cpu_pct", [(un - 49 * 3600, 1.0), (un - 47 * 3600, 2.0), (un - 3 * 3600, 3.0)])
    with sessions.begin() as s:
        assert prune(s, now)["samples"] == 1  # default 48 h
    with sessions.begin() as s:
        set_setting(s, "samples_retention_h", 2)
    with sessions.begin() as s:
        assert prune(s, now)["samples"] == 2
    assert count(sessions, Sample) == 0


@pytest.mark.parametrize(("span", "table"), [
    (timedelta(minutes=5), "samples"),
    (timedelta(hours=1), "samples"),
    (timedelta(hours=1, seconds=1), "rollups_1m"),
    (timedelta(hours=24), "rollups_1m"),
    (timedelta(hours=48), "rollups_1m"),
    (timedelta(days=7), "rollups_1h"),
])
def test_resolution_by_range(span, table):
    assert resolution(T0, T0 + span) == table


def test_series_reads_the_table_its_range_calls_for(sessions):
    # Three hours of 1-second samples: value = seconds since T0 (so means are easy to know).
    put(sessions, "runner:gemma@local", "gen_tok_s", [(at, float(at - U0)) for at in range(U0, U0 + 3 * 3600)])
    run_rollup(sessions, T0 + timedelta(hours=3, minutes=1))
    with sessions() as s:
        raw = series(s, "runner:gemma@local", "gen_tok_s", T0, T0 + timedelta(minutes=5))
        minutes = series(s, "runner:gemma@local", "gen_tok_s", T0, T0 + timedelta(hours=2))
        hours = series(s, "runner:gemma@local", "gen_tok_s", T0, T0 + timedelta(days=3))
        missing = series(s, "runner:other@local", "gen_tok_s", T0, T0 + timedelta(minutes=5))
    assert len(raw) == 301 and raw[0] == (T0, 0.0) and raw[-1] == (T0 + timedelta(minutes=5), 300.0)
    # Minute buckets T0 .. T0+2h inclusive; each mean is the middle of its 60 values.
    assert len(minutes) == 121
    assert minutes[0] == (T0, 29.5) and minutes[1] == (T0 + timedelta(minutes=1), 89.5)
    assert [t for t, _ in hours] == [T0, T0 + timedelta(hours=1), T0 + timedelta(hours=2)]
    assert hours[0][1] == pytest.approx(1799.5) and hours[2][1] == pytest.approx(2 * 3600 + 1799.5)
    assert missing == []
    assert from_unix(U0) == T0


def test_migration_0003_upgrades_a_0002_store_and_matches_the_models(make_store):
    engine = make_store(revision="0002")
    assert "samples" not in inspect(engine).get_table_names()
    with engine.begin() as connection:
        connection.exec_driver_sql("INSERT INTO settings (key, value, updated_at)"
                                   " VALUES ('rescan_interval_s', '30', '2025-01-01 10:00:00.000000')")
    db.upgrade(engine)
    assert db.current_revision(engine) == db.head_revision()
    tables = set(inspect(engine).get_table_names())
    assert {"series", "samples", "rollups_1m", "rollups_1h", "settings"} <= tables
    with engine.connect() as connection:
        assert connection.exec_driver_sql("SELECT key FROM settings").scalar() == "rescan_interval_s"
        # The big tables are clustered on their key: WITHOUT ROWID.
        for table in ("samples", "rollups_1m", "rollups_1h"):
            sql = connection.exec_driver_sql(f"SELECT sql FROM sqlite_master WHERE name = '{table}'").scalar()
            assert "WITHOUT ROWID" in sql
        diff = compare_metadata(MigrationContext.configure(connection), Base.metadata)
    assert diff == []
    db.downgrade(engine, "0002")
    assert not {"series", "samples", "rollups_1m", "rollups_1h"} & set(inspect(engine).get_table_names())
    db.upgrade(engine)
    with engine.connect() as connection:
        assert connection.execute(text("SELECT count(*) FROM samples")).scalar() == 0


def test_the_rollup_jobs_run_on_the_store_writer_at_their_clocks_time(engine, sessions):
    from app.store.writer import StoreWriter
    from app.telemetry.rollup import Rollups

    put(sessions, "host", "cpu_pct", [(U0, 1.0), (U0 - 49 * 3600, 5.0)])
    writer = StoreWriter(engine)
    writer.start()
    try:
        jobs = Rollups(writer, clock=lambda: T0 + timedelta(seconds=60 + GRACE_S))
        jobs.rollup_samples()
        assert writer.flush(timeout_s=10)
        assert rows(sessions, Rollup1m)[-1] == (U0, 1.0, 1.0, 1.0, 1)
        jobs.prune_samples()  # the default retention, 48 h, before the clock's time
        assert writer.flush(timeout_s=10)
        assert count(sessions, Sample) == 1
    finally:
        writer.stop(timeout_s=5)
