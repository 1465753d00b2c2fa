"""Connections and migrations on real SQLite files."""

import shutil
import sqlite3
import textwrap
from datetime import UTC, datetime

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import MetaData, inspect, select, text
from sqlalchemy.exc import IntegrityError, OperationalError

from app.store import db
from app.store.models import ApiToken, Base, Model, Node, RequestRecord, RunnerSettings, Setting

HEAD_TABLES = {
    "alembic_version", "models", "runner_settings", "nodes", "residency_events", "request_classes",
    "members", "api_tokens", "requests", "settings", "series", "samples", "rollups_1m", "rollups_1h",
    "bench_sessions", "bench_runs", "bench_requests", "bench_applied", "refusals", "preload_schedule",
}
HEAD = "0022"


def test_database_path_is_in_the_data_folder(tmp_path):
    assert db.database_path(tmp_path) == tmp_path / "hearth.db"


def test_connections_use_wal_foreign_keys_busy_timeout_and_normal_sync(make_store):
    engine = make_store(revision=None, busy_timeout_ms=1234)
    with engine.connect() as connection:
        assert connection.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
        assert connection.exec_driver_sql("PRAGMA foreign_keys").scalar() == 1
        assert connection.exec_driver_sql("PRAGMA busy_timeout").scalar() == 1234
        assert connection.exec_driver_sql("PRAGMA synchronous").scalar() == 1  # NORMAL
    # WAL is a property of the file: a plain connection sees it too.
    raw = sqlite3.connect(engine.url.database)
    try:
        assert raw.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    finally:
        raw.close()


def test_migrates_an_empty_database_to_head(make_store):
    engine = make_store(revision=None)
    assert db.current_revision(engine) is None
    db.upgrade(engine)
    assert db.current_revision(engine) == db.head_revision() == HEAD
    assert set(inspect(engine).get_table_names()) == HEAD_TABLES
    # Migrations run with foreign keys off; the pooled connection must not keep that.
    with engine.connect() as connection:
        assert connection.exec_driver_sql("PRAGMA foreign_keys").scalar() == 1


def test_upgrade_at_head_is_a_no_op(engine):
    db.upgrade(engine)
    assert db.current_revision(engine) == HEAD


# Rows as a 0001-era Hearth would have left them, written as plain SQL (not through today's models).
ROWS_AT_0001 = [
    "INSERT INTO models (id, name, path, source, size_bytes, architecture, has_chat_template, usable,"
    " first_seen_at, last_seen_at) VALUES (1, 'gemma', '/models/gemma.gguf', 'folder', 1000, 'gemma3', 1, 1,"
    " '2025-01-01 10:00:00.000000', '2025-01-02 10:00:00.000000')",
    "INSERT INTO runner_settings (model_id, kind, n_ctx, parallel) VALUES (1, 'hearth', 8192, 4)",
    "INSERT INTO members (id, name, created_at) VALUES (7, 'ana', '2025-01-01 10:00:00.000000')",
    "INSERT INTO api_tokens (member_id, prefix, token_hash, default_class, allowed_classes, created_at)"
    f" VALUES (7, 'hth_abcdefgh', '{'a' * 64}', 'chat', '[\"chat\", \"voice\"]', '2025-01-01 10:00:00.000000')",
    "INSERT INTO requests (arrival_at, member_name, class_name, model, stream, prompt_tokens, completion_tokens,"
    " ttft_ms, status, http_status)"
    " VALUES ('2025-01-03 08:00:00.250000', 'ana', 'chat', 'gemma', 1, 12, 34, 56.5, 'ok', 200)",
    "INSERT INTO residency_events (at, model_name, event, reason, cold_start_ms)"
    " VALUES ('2025-01-03 07:59:00.000000', 'gemma', 'load', 'request', 812.0)",
    "INSERT INTO settings (key, value, updated_at) VALUES ('retention_days', '30', '2025-01-01 10:00:00.000000')",
]


def _insert_0001_rows(engine):
    with engine.begin() as connection:
        for sql in ROWS_AT_0001:
            connection.exec_driver_sql(sql)


def test_upgrades_a_0001_database_with_data_and_keeps_it(make_store):
    engine = make_store(revision="0001")
    assert db.current_revision(engine) == "0001"
    assert "nodes" not in inspect(engine).get_table_names()
    assert "queue_position" not in {c["name"] for c in inspect(engine).get_columns("requests")}
    _insert_0001_rows(engine)

    db.upgrade(engine)

    assert db.current_revision(engine) == HEAD
    sessions = db.session_factory(engine)
    with sessions() as session:
        model = session.get(Model, 1)
        assert (model.name, model.has_chat_template) == ("gemma", True)
        assert (model.policy, model.keep_alive_s) == ("keep_alive", 300)  # server defaults
        assert model.first_seen_at == datetime(2025, 1, 1, 10, tzinfo=UTC)
        assert session.scalars(select(RunnerSettings)).one().n_ctx == 8192
        record = session.scalars(select(RequestRecord)).one()
        assert (record.member_name, record.ttft_ms, record.stream) == ("ana", 56.5, True)
        assert (record.queue_position, record.num_preemptions) == (None, 0)
        assert record.arrival_at == datetime(2025, 1, 3, 8, 0, 0, 250000, tzinfo=UTC)
        assert session.get(Setting, "retention_days").value == 30
        assert session.scalars(select(ApiToken.allowed_classes)).one() == ["chat", "voice"]
        # The new table works with the old rows.
        session.add(Node(model_id=1, url="http://nas2:8080", label="nas2"))
        record.queue_position = 3
        session.commit()
    with sessions() as session:
        assert session.scalars(select(Node.label)).all() == ["nas2"]
        assert session.scalars(select(RequestRecord.queue_position)).one() == 3


def test_downgrade_to_0001_and_back_keeps_the_data(make_store):
    engine = make_store(revision="0001")
    _insert_0001_rows(engine)
    db.upgrade(engine)
    db.downgrade(engine, "0001")
    assert db.current_revision(engine) == "0001"
    assert "nodes" not in inspect(engine).get_table_names()
    db.upgrade(engine)
    with engine.connect() as connection:
        assert connection.execute(text("SELECT model, prompt_tokens FROM requests")).one() == ("gemma", 12)
        assert connection.execute(text("SELECT count(*) FROM api_tokens")).scalar() == 1


def test_head_schema_matches_the_models(engine):
    with engine.connect() as connection:
        options = {"compare_type": True, "compare_server_default": True}
        context = MigrationContext.configure(connection, opts=options)
        assert compare_metadata(context, Base.metadata) == []
        # The comparison does see differences: against no tables at all, every table is extra.
        removed = {diff[1].name for diff in compare_metadata(context, MetaData()) if diff[0] == "remove_table"}
        assert removed == HEAD_TABLES - {"alembic_version"}


def test_foreign_keys_are_enforced_and_cascade(sessions):
    with sessions() as session:
        session.add(RunnerSettings(model_id=99))
        with pytest.raises(IntegrityError):
            session.commit()
    with sessions() as session:
        model = Model(name="m", source="folder")
        session.add(model)
        session.flush()
        session.add_all([RunnerSettings(model_id=model.id), Node(model_id=model.id, url="http://x")])
        session.commit()
        session.delete(model)
        session.commit()
        assert session.scalars(select(Node)).all() == []
        assert session.scalars(select(RunnerSettings)).all() == []


def test_check_constraints_reject_unknown_values(sessions):
    with sessions() as session:
        session.add(Model(name="m", source="usb-stick"))
        with pytest.raises(IntegrityError, match="ck_models_source"):
            session.commit()


def test_migrations_dir_honours_the_environment(tmp_path, monkeypatch):
    assert (db.migrations_dir() / "env.py").is_file()
    (tmp_path / "env.py").write_text("")
    monkeypatch.setenv("HEARTH_MIGRATIONS_DIR", str(tmp_path))
    assert db.migrations_dir() == tmp_path


def _migrations_with_scratch(tmp_path, monkeypatch, body):
    folder = tmp_path / "migrations"
    shutil.copytree(db.migrations_dir(), folder, ignore=shutil.ignore_patterns("__pycache__"))
    (folder / "versions" / "9999_test.py").write_text(
        "import sqlalchemy as sa\nfrom alembic import op\n\n"
        f'revision = "9999"\ndown_revision = "{HEAD}"\nbranch_labels = None\ndepends_on = None\n\n\n'
        f"def upgrade():\n{textwrap.indent(textwrap.dedent(body), '    ')}\n\n"
        "def downgrade():\n    pass\n"
    )
    monkeypatch.setenv("HEARTH_MIGRATIONS_DIR", str(folder))


def _add_model_with_node(engine):
    with db.session_factory(engine)() as session:
        model = Model(name="gemma", source="folder")
        session.add(model)
        session.flush()
        session.add(Node(model_id=model.id, url="http://nas2:8080"))
        session.commit()


# Rebuilding a table that others reference (batch mode: copy, drop, rename) must not cascade.
REBUILD_MODELS = """
with op.batch_alter_table("models", recreate="always") as batch:
    batch.add_column(sa.Column("extra", sa.Integer()))
"""


def test_a_table_rebuild_keeps_the_rows_that_reference_it(make_store, tmp_path, monkeypatch):
    engine = make_store()
    _add_model_with_node(engine)
    _migrations_with_scratch(tmp_path, monkeypatch, REBUILD_MODELS)
    db.upgrade(engine)
    assert db.current_revision(engine) == "9999"
    assert "extra" in {c["name"] for c in inspect(engine).get_columns("models")}
    with engine.connect() as connection:
        assert connection.exec_driver_sql("SELECT url FROM nodes").scalars().all() == ["http://nas2:8080"]


def test_a_failing_upgrade_leaves_the_database_as_it_was(make_store, tmp_path, monkeypatch):
    engine = make_store()
    _add_model_with_node(engine)
    failing = REBUILD_MODELS + 'op.create_table("scratch", sa.Column("id", sa.Integer()))\nraise RuntimeError("boom")\n'
    _migrations_with_scratch(tmp_path, monkeypatch, failing)
    with pytest.raises(RuntimeError, match="boom"):
        db.upgrade(engine)
    assert db.current_revision(engine) == HEAD
    assert set(inspect(engine).get_table_names()) == HEAD_TABLES
    assert "extra" not in {c["name"] for c in inspect(engine).get_columns("models")}
    with engine.connect() as connection:
        assert connection.exec_driver_sql("SELECT count(*) FROM nodes").scalar() == 1


def test_0011_gives_existing_tokens_no_permission_and_members_no_limits(make_store):
    engine = make_store(revision="0010")
    _insert_0001_rows(engine)
    db.upgrade(engine)
    with engine.connect() as connection:
        assert connection.execute(text("SELECT may_manage, trust_user_headers FROM api_tokens")).one() == (0, 0)
        assert connection.execute(text("SELECT name, parent_id, max_concurrent, max_queue, max_requests_per_min, "
                                       "max_tokens_per_min, max_tokens_per_day FROM members")).one() == \
            ("ana", None, None, None, None, None, None)
    # A person under a member is unique per (member, external id); deleting the member takes its people along.
    with engine.begin() as connection:
        connection.exec_driver_sql("INSERT INTO members (name, created_at, parent_id, external_id) "
                                   "VALUES ('ana/Bob', '2025-01-01 10:00:00', 7, 'u1')")
        with pytest.raises(IntegrityError):
            with connection.begin_nested():
                connection.exec_driver_sql("INSERT INTO members (name, created_at, parent_id, external_id) "
                                           "VALUES ('ana/Bobby', '2025-01-01 10:00:00', 7, 'u1')")
        connection.exec_driver_sql("DELETE FROM members WHERE id = 7")
        assert connection.exec_driver_sql("SELECT count(*) FROM members").scalar() == 0
    db.downgrade(engine, "0010")
    assert "refusals" not in inspect(engine).get_table_names()
    assert "may_manage" not in {c["name"] for c in inspect(engine).get_columns("api_tokens")}


def _read_then_write_after_another_commit(sessions, other_engine):
    """A unit of work that reads, sees another connection commit, then writes (a token made while serve logs)."""
    with sessions() as s:
        s.scalar(select(Setting).where(Setting.key == "nothing"))  # the transaction's snapshot starts here
        with other_engine.begin() as c:
            c.execute(text("INSERT INTO settings (key, value, updated_at) VALUES ('other', '1', '2026-12-03 00:00:00')"))
        s.add(Setting(key="mine", value="1"))
        s.commit()


def test_a_plain_session_that_read_is_refused_its_write_after_another_commit(tmp_path):
    engine, plain = db.open_store(tmp_path)  # open_store's sessions are plain ones
    other = db.make_engine(db.database_path(tmp_path))
    # The commit waits for nothing: the plain session's snapshot is stale, so SQLite refuses at once.
    with pytest.raises(OperationalError, match="database is locked"):
        _read_then_write_after_another_commit(plain, other)
    engine.dispose(), other.dispose()


def test_a_writing_session_takes_the_lock_first_so_its_write_cannot_be_refused(tmp_path):
    engine, _ = db.open_store(tmp_path)
    sessions = db.writing_sessions(engine)
    impatient = db.make_engine(db.database_path(tmp_path), busy_timeout_ms=0)
    with sessions() as s:
        s.scalar(select(Setting).where(Setting.key == "nothing"))
        # The lock is held from BEGIN: another writer cannot commit in between (it would wait; this one does not).
        with pytest.raises(OperationalError, match="database is locked"):
            _insert(impatient)
        s.add(Setting(key="mine", value="1"))
        s.commit()
    assert _insert(impatient)  # and it is free again once the session ends
    with db.session_factory(engine)() as s:
        assert {r.key for r in s.scalars(select(Setting))} >= {"mine", "other"}
    engine.dispose(), impatient.dispose()


def _insert(engine) -> bool:
    with engine.begin() as c:
        c.execute(text("INSERT INTO settings (key, value, updated_at) VALUES ('other', '1', '2026-12-03 00:00:00')"))
    return True



def _count_elsewhere(path, write: bool = False) -> int:
    """Rows of t as another process sees them (after inserting one, when `write`)."""
    import subprocess
    import sys

    script = ("import sqlite3, sys; c = sqlite3.connect(sys.argv[1])\n"
              + ("c.execute('INSERT INTO t VALUES (100)'); c.commit()\n" if write else "")
              + "print(c.execute('SELECT count(*) FROM t').fetchone()[0])")
    return int(subprocess.run([sys.executable, "-c", script, str(path)], capture_output=True, text=True,
                              check=True).stdout)


def test_opening_the_store_again_loses_no_write_of_this_process(tmp_path):
    """make_engine on a database this process already has open must not open and close a descriptor of it: SQLite's
    POSIX locks belong to the process and closing any descriptor drops them all, so the next process to open the
    file took the WAL for its own and this process's later commits were lost to every other reader (a serve's
    request log and residency events came back empty)."""
    path = tmp_path / "hearth.db"
    first = db.make_engine(path)
    with first.begin() as conn:
        conn.exec_driver_sql("CREATE TABLE t (x INTEGER)")
    conn = first.connect()
    try:
        for i in range(5):
            conn.exec_driver_sql(f"INSERT INTO t VALUES ({i})")
            conn.commit()
        db.make_engine(path).dispose()  # a second engine on the same file, as serve opens one beside its writer's
        assert _count_elsewhere(path, write=True) == 6
        for i in range(5):
            conn.exec_driver_sql(f"INSERT INTO t VALUES ({10 + i})")
            conn.commit()
        assert conn.exec_driver_sql("SELECT count(*) FROM t").scalar() == 11
        assert _count_elsewhere(path) == 11
    finally:
        conn.close()
        first.dispose()
