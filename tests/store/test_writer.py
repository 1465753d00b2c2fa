"""The batching store writer on a real SQLite file."""

import logging
import sqlite3
import threading
import time
from datetime import UTC, datetime

from sqlalchemy import event, func, select
from sqlalchemy.exc import IntegrityError, OperationalError

from app.store.db import session_factory
from app.store.models import Member, RequestRecord
from app.store.writer import StoreWriter, is_transient


def _record(i):
    return RequestRecord(arrival_at=datetime.now(UTC), class_name="chat", prompt_tokens=i, status="ok")


def _count(engine, model):
    with session_factory(engine)() as session:
        return session.scalar(select(func.count()).select_from(model))


def _count_commits(engine):
    commits = []
    event.listen(engine, "commit", lambda connection: commits.append(1))
    return commits


def test_batches_queued_items_into_few_commits(engine):
    commits = _count_commits(engine)
    writer = StoreWriter(engine, max_batch=500)
    for i in range(1200):
        writer.add(_record(i))
    writer.start()
    assert writer.flush(10)
    assert writer.num_written == 1200
    assert _count(engine, RequestRecord) == 1200
    # Queued before start, so the batches are full: 500 + 500 + 200.
    assert writer.num_commits == len(commits) == 3
    assert writer.stop(5)


def test_items_arriving_within_the_window_share_a_commit(engine):
    commits = _count_commits(engine)
    writer = StoreWriter(engine, batch_window_s=0.5)
    writer.start()
    for i in range(20):
        writer.add(_record(i))
        time.sleep(0.005)
    assert writer.stop(5)
    assert writer.num_written == 20
    assert len(commits) == 1


def test_flush_waits_for_everything_submitted_before_it(engine):
    writer = StoreWriter(engine, batch_window_s=5.0)
    writer.start()
    started = time.monotonic()
    for i in range(10):
        writer.add(_record(i))
    assert writer.flush(10)
    # A flush doesn't sit out the batch window.
    assert time.monotonic() - started < 2.5
    assert _count(engine, RequestRecord) == 10
    assert writer.num_pending == 0
    assert writer.stop(5)


def test_flush_times_out_when_the_writer_is_not_running(engine):
    writer = StoreWriter(engine)
    writer.add(_record(0))
    assert writer.flush(0.05) is False
    assert writer.flush(0.0) is False
    assert StoreWriter(engine).flush(0.0) is True  # nothing submitted, nothing to wait for


def test_submit_runs_arbitrary_work_in_a_write_transaction(engine):
    writer = StoreWriter(engine)
    writer.start()
    writer.add(Member(name="ana"))

    def rename(session):
        session.scalars(select(Member).where(Member.name == "ana")).one().name = "bea"

    writer.submit(rename)
    assert writer.stop(5)
    with session_factory(engine)() as session:
        assert session.scalars(select(Member.name)).all() == ["bea"]


def test_add_copies_the_object_and_stamps_defaults_at_submit_time(engine):
    writer = StoreWriter(engine)
    member = Member(name="ana")
    before = datetime.now(UTC)
    writer.add(member)
    after_add = datetime.now(UTC)
    member.name = "changed after add"
    time.sleep(0.05)
    writer.start()
    assert writer.stop(5)
    assert member.id is None
    with session_factory(engine)() as session:
        stored = session.scalars(select(Member)).one()
    assert stored.name == "ana"
    assert before <= stored.created_at <= after_add


def test_a_bad_item_is_isolated_and_the_rest_of_its_batch_kept(engine, caplog):
    writer = StoreWriter(engine)
    writer.add(Member(name="ana"))
    for name in ["bea", "ana", "cid", "dan"]:  # the second "ana" breaks the UNIQUE constraint
        writer.add(Member(name=name))

    def broken(session):
        raise RuntimeError("bug in a caller's work")

    writer.submit(broken)
    writer.add(Member(name="eve"))
    with caplog.at_level(logging.ERROR, logger="app.store.writer"):
        writer.start()
        assert writer.flush(10)
    with session_factory(engine)() as session:
        assert sorted(session.scalars(select(Member.name))) == ["ana", "bea", "cid", "dan", "eve"]
    assert (writer.num_written, writer.num_failed_items, writer.num_failed_batches) == (5, 2, 0)
    assert "UNIQUE constraint failed: members.name" in caplog.text
    assert "bug in a caller's work" in caplog.text
    assert writer.stop(5)


def _hold_write_lock(engine, seconds, locked):
    raw = sqlite3.connect(engine.url.database, isolation_level=None)
    try:
        raw.execute("BEGIN EXCLUSIVE")
        locked.set()
        time.sleep(seconds)
        raw.execute("COMMIT")
    finally:
        raw.close()


def test_a_locked_database_is_retried_and_nothing_lost(make_store):
    engine = make_store(busy_timeout_ms=10)  # fail fast, so the writer's own retry does the waiting
    writer = StoreWriter(engine, max_retries=8, retry_base_s=0.05)
    locked = threading.Event()
    holder = threading.Thread(target=_hold_write_lock, args=(engine, 0.5, locked))
    holder.start()
    assert locked.wait(5)
    for i in range(100):
        writer.add(_record(i))
    writer.start()
    assert writer.flush(10)
    holder.join()
    assert writer.num_retries >= 1
    assert (writer.num_written, writer.num_failed_items, writer.num_failed_batches) == (100, 0, 0)
    assert _count(engine, RequestRecord) == 100
    assert writer.stop(5)


def test_a_batch_is_given_up_after_the_retry_limit(make_store, caplog):
    engine = make_store(busy_timeout_ms=10)
    writer = StoreWriter(engine, max_retries=2, retry_base_s=0.01)
    locked = threading.Event()
    holder = threading.Thread(target=_hold_write_lock, args=(engine, 1.0, locked))
    holder.start()
    assert locked.wait(5)
    for i in range(3):
        writer.add(_record(i))
    with caplog.at_level(logging.ERROR, logger="app.store.writer"):
        writer.start()
        assert writer.flush(10)
    assert (writer.num_written, writer.num_failed_items, writer.num_failed_batches) == (0, 3, 1)
    assert writer.num_retries == 2
    assert "gave up a batch of 3 items" in caplog.text
    holder.join()
    writer.add(_record(4))  # the writer goes on once the lock is gone
    assert writer.stop(5)
    assert _count(engine, RequestRecord) == 1


def test_a_full_queue_drops_the_newest_items_and_counts_them(engine, caplog):
    writer = StoreWriter(engine, max_queue=5)
    with caplog.at_level(logging.WARNING, logger="app.store.writer"):
        accepted = [writer.add(Member(name=f"m{i}")) for i in range(8)]
    assert accepted == [True] * 5 + [False] * 3
    assert writer.num_dropped == 3
    assert "queue full" in caplog.text
    writer.start()
    assert writer.stop(5)
    with session_factory(engine)() as session:
        assert sorted(session.scalars(select(Member.name))) == ["m0", "m1", "m2", "m3", "m4"]


def test_stop_writes_what_is_queued_then_refuses_more(engine):
    writer = StoreWriter(engine, batch_window_s=5.0)
    writer.start()
    for i in range(50):
        writer.add(_record(i))
    assert writer.stop(5)
    assert _count(engine, RequestRecord) == 50
    assert writer.submit(lambda session: None) is False
    assert writer.num_dropped == 1
    assert writer.stop(1)  # a second stop is harmless


def test_transient_errors_are_told_from_bad_data(make_store):
    engine = make_store(busy_timeout_ms=10)

    def error_of(sql):
        with engine.begin() as connection:
            try:
                connection.exec_driver_sql(sql)
            except Exception as error:
                return error
        raise AssertionError(f"{sql} did not fail")

    unique = error_of("INSERT INTO members (id, name, created_at) VALUES (1, NULL, '2025-01-01')")
    assert isinstance(unique, IntegrityError) and not is_transient(unique)
    assert not is_transient(error_of("SELECT * FROM no_such_table"))
    assert not is_transient(ValueError("not a database error"))
    locked = threading.Event()
    holder = threading.Thread(target=_hold_write_lock, args=(engine, 0.3, locked))
    holder.start()
    assert locked.wait(5)
    busy = error_of("INSERT INTO members (name, created_at) VALUES ('ana', '2025-01-01')")
    holder.join()
    assert isinstance(busy, OperationalError) and "locked" in str(busy)
    assert is_transient(busy)
