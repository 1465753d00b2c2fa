"""A full or read-only data folder: the writer counts what it loses, never blocks, and resumes by itself.

The real-disk tests mount a small tmpfs (root only; skipped elsewhere). The injected test raises
SQLite's own "disk is full" error at the cursor, so the counting is checked on every machine.
"""

from __future__ import annotations

import sqlite3
import subprocess
import time
from datetime import UTC, datetime

from sqlalchemy import event, func, select

from app.store.db import database_path, make_engine, session_factory, upgrade
from app.store.models import RequestRecord
from app.store.writer import StoreWriter


def _record(i: int) -> RequestRecord:
    return RequestRecord(arrival_at=datetime.now(UTC), class_name="chat", prompt_tokens=i, status="ok",
                         error="x" * 200)


def _count(engine) -> int:
    with session_factory(engine)() as s:
        return s.scalar(select(func.count()).select_from(RequestRecord))


def test_injected_disk_full_is_counted_never_blocks_and_writing_resumes(tmp_path):
    engine = make_engine(database_path(tmp_path))
    upgrade(engine)
    full = {"on": True}

    @event.listens_for(engine, "before_cursor_execute")
    def disk_full(conn, cursor, statement, parameters, context, executemany):
        if full["on"] and statement.startswith("INSERT"):
            error = sqlite3.OperationalError("database or disk is full")
            error.sqlite_errorcode = sqlite3.SQLITE_FULL
            raise error

    writer = StoreWriter(engine, max_retries=2, retry_base_s=0.01, clock=lambda: 1000.0)
    writer.start()
    started = time.monotonic()
    assert all(writer.add(_record(i)) for i in range(50))
    assert time.monotonic() - started < 0.5  # submit never waits on the disk
    assert writer.flush(10)
    health = writer.health()
    assert health["lost_by_reason"] == {"disk_full": 50} and health["lost_total"] == 50
    assert health["failing"] and not health["ok"]
    assert "disk is full" in health["last_error"] and health["last_error_at"] == 1000.0
    assert writer.num_retries >= 2
    full["on"] = False  # space returns
    for i in range(5):
        writer.add(_record(i))
    assert writer.flush(10)
    assert _count(engine) == 5
    health = writer.health()
    assert not health["failing"] and health["lost_total"] == 50 and health["written_total"] == 5
    assert writer.stop(5)
    engine.dispose()


def test_a_really_full_disk_loses_rows_by_count_and_resumes_when_space_returns(tmpfs, fill_disk):
    data = tmpfs("data", "4m")
    engine = make_engine(database_path(data))
    upgrade(engine)
    writer = StoreWriter(engine, max_retries=1, retry_base_s=0.01, max_batch=200)
    writer.start()
    filler = fill_disk(data)
    for i in range(3000):
        writer.add(_record(i))
    assert writer.flush(60)
    lost = writer.health()["lost_by_reason"]
    assert lost.get("disk_full", 0) > 0, writer.health()
    assert writer.num_written + sum(lost.values()) == 3000
    filler.unlink()
    before = _count(engine)
    for i in range(20):
        writer.add(_record(i))
    assert writer.flush(30)
    assert _count(engine) == before + 20
    assert not writer.health()["failing"]
    assert writer.stop(5)
    engine.dispose()


def test_a_read_only_data_folder_is_counted_and_writing_resumes_after_remount(tmpfs):
    data = tmpfs("data", "16m")
    engine = make_engine(database_path(data))
    upgrade(engine)
    writer = StoreWriter(engine, max_retries=1, retry_base_s=0.01)
    writer.start()
    writer.add(_record(0))
    assert writer.flush(10) and _count(engine) == 1
    # A file open for writing keeps a remount busy: let the pool close its connections first (the
    # writer opens a new one for its next batch, which then finds the folder read-only).
    engine.dispose()
    subprocess.run(["mount", "-o", "remount,ro", str(data)], check=True)
    try:
        for i in range(10):
            writer.add(_record(i))
        assert writer.flush(30)
        health = writer.health()
        assert health["failing"] and health["lost_total"] == 10, health
        assert set(health["lost_by_reason"]) <= {"read_only", "io_error", "cannot_open"}, health
    finally:
        subprocess.run(["mount", "-o", "remount,rw", str(data)], check=True)
    writer.add(_record(99))
    assert writer.flush(10)
    assert _count(engine) == 2 and not writer.health()["failing"]
    assert writer.stop(5)
    engine.dispose()
