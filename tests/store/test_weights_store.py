"""Warm weights and the cold-start split in the store: migration 0014 on a real SQLite file and its check."""

from __future__ import annotations

import pytest
from sqlalchemy import inspect, text
from sqlalchemy.exc import IntegrityError

from app.residency.pagecache import WEIGHTS_CHOICES
from app.store import db

LOAD_COLUMNS = {"load_read_ms", "load_context_ms", "load_upload_ms", "load_restore_ms", "first_prefill_ms",
                "weights_source", "kv_source"}


def _columns(engine, table: str) -> set[str]:
    return {c["name"] for c in inspect(engine).get_columns(table)}


def _rows_at_0013(engine) -> None:
    with engine.begin() as connection:
        connection.execute(text("INSERT INTO models (id, name, source, first_seen_at, last_seen_at) "
                                "VALUES (1, 'gemma', 'folder', '2026-01-01 10:00:00', '2026-01-01 10:00:00')"))
        connection.execute(text("INSERT INTO runner_settings (model_id, kind, parallel, speculation) "
                                "VALUES (1, 'hearth', 4, 'off')"))
        connection.execute(text("INSERT INTO residency_events (at, model_name, event, reason, cold_start_ms) "
                                "VALUES ('2026-01-02 08:00:00', 'gemma', 'load', 'first request', 2400.0)"))


def test_0014_leaves_every_model_warm_and_old_loads_unsplit(make_store):
    engine = make_store(revision="0013")
    _rows_at_0013(engine)
    db.upgrade(engine)
    with engine.connect() as connection:
        assert connection.execute(text("SELECT speculation, weights FROM runner_settings")).one() == ("off", None)
        row = connection.execute(text(f"SELECT cold_start_ms, {', '.join(sorted(LOAD_COLUMNS))} "
                                      "FROM residency_events")).one()
        assert row[0] == 2400.0 and set(row[1:]) == {None}
    with engine.begin() as connection:
        for value in WEIGHTS_CHOICES:
            connection.execute(text("UPDATE runner_settings SET weights = :v"), {"v": value})
    with pytest.raises(IntegrityError, match="ck_runner_settings_weights"):
        with engine.begin() as connection:
            connection.execute(text("UPDATE runner_settings SET weights = 'hot'"))


def test_0014_down_and_up_again_keeps_the_rest(make_store):
    engine = make_store(revision="0013")
    _rows_at_0013(engine)
    db.upgrade(engine)
    with engine.begin() as connection:
        connection.execute(text("UPDATE runner_settings SET weights = 'cold'"))
        connection.execute(text("UPDATE residency_events SET load_read_ms = 300, weights_source = 'disk'"))
    db.downgrade(engine, "0013")
    assert db.current_revision(engine) == "0013"
    assert "weights" not in _columns(engine, "runner_settings")
    assert LOAD_COLUMNS.isdisjoint(_columns(engine, "residency_events"))
    db.upgrade(engine)
    with engine.connect() as connection:
        assert connection.execute(text("SELECT speculation, weights FROM runner_settings")).one() == ("off", None)
        assert connection.execute(text("SELECT cold_start_ms, load_read_ms FROM residency_events")).one() == \
            (2400.0, None)
    names = {c["name"] for c in inspect(engine).get_check_constraints("runner_settings")}
    assert {"ck_runner_settings_speculation", "ck_runner_settings_weights"} <= names
