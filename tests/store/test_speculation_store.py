"""Speculative decoding in the store: migration 0013 on a real SQLite file, its check, and the seeded classes."""

from __future__ import annotations

import pytest
from sqlalchemy import inspect, text
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from app.residency.runner_spec import SPECULATION_SETTINGS
from app.store import db
from app.store.models import Model, RequestClass, RequestRecord, RunnerSettings, utcnow

CLASS_ROW = ("INSERT INTO request_classes (name, priority, ttft_target_ms, tpot_target_ms, default_max_tokens, "
             "max_output_tokens, max_concurrent, max_queue, weight, preemptible, queue_timeout_s, thinking) "
             "VALUES (:name, 1, 500, 100, 128, 256, 4, 8, 1.0, 0, 10.0, 'model')")


def _columns(engine, table: str) -> set[str]:
    return {c["name"] for c in inspect(engine).get_columns(table)}


def _rows_at_0012(engine) -> None:
    with engine.begin() as connection:
        connection.execute(text("INSERT INTO models (id, name, source, first_seen_at, last_seen_at) "
                                "VALUES (1, 'gemma', 'folder', '2026-01-01 10:00:00', '2026-01-01 10:00:00')"))
        connection.execute(text("INSERT INTO runner_settings (model_id, kind, parallel) VALUES (1, 'hearth', 4)"))
        for name in ("voice", "kitchen"):
            connection.execute(text(CLASS_ROW), {"name": name})
        connection.execute(text("INSERT INTO requests (arrival_at, class_name, stream, status, num_preemptions) "
                                "VALUES ('2026-01-02 08:00:00', 'voice', 0, 'ok', 0)"))


def test_0013_adds_the_settings_as_auto_and_on_and_leaves_old_requests_without_drafts(make_store):
    engine = make_store(revision="0012")
    _rows_at_0012(engine)
    db.upgrade(engine)
    with engine.connect() as connection:
        assert connection.execute(text("SELECT parallel, speculation FROM runner_settings")).one() == (4, None)
        assert dict(connection.execute(text("SELECT name, speculation FROM request_classes")).all()) == \
            {"voice": 1, "kitchen": 1}
        assert connection.execute(text("SELECT draft_tokens, draft_accepted FROM requests")).one() == (None, None)
    # Every allowed value is stored; anything else is refused by the named check.
    with engine.begin() as connection:
        for value in SPECULATION_SETTINGS:
            connection.execute(text("UPDATE runner_settings SET speculation = :v"), {"v": value})
    with pytest.raises(IntegrityError, match="ck_runner_settings_speculation"):
        with engine.begin() as connection:
            connection.execute(text("UPDATE runner_settings SET speculation = 'draft-simple'"))


def test_0013_down_and_up_again_keeps_the_rest(make_store):
    engine = make_store(revision="0012")
    _rows_at_0012(engine)
    db.upgrade(engine)
    with engine.begin() as connection:
        connection.execute(text("UPDATE runner_settings SET speculation = 'off'"))
        connection.execute(text("UPDATE request_classes SET speculation = 0 WHERE name = 'kitchen'"))
        connection.execute(text("UPDATE requests SET draft_tokens = 40, draft_accepted = 31"))
    db.downgrade(engine, "0012")
    assert db.current_revision(engine) == "0012"
    assert "speculation" not in _columns(engine, "runner_settings")
    assert "speculation" not in _columns(engine, "request_classes")
    assert {"draft_tokens", "draft_accepted"}.isdisjoint(_columns(engine, "requests"))
    assert not any(c["name"] == "ck_runner_settings_speculation"
                   for c in inspect(engine).get_check_constraints("runner_settings"))
    db.upgrade(engine)
    with engine.connect() as connection:
        assert connection.execute(text("SELECT parallel, speculation FROM runner_settings")).one() == (4, None)
        assert connection.execute(text("SELECT count(*) FROM requests")).scalar() == 1
    # The kind and mode checks of 0001 survive the table rebuilds (0001's names carry the prefix twice).
    names = sorted(c["name"] for c in inspect(engine).get_check_constraints("runner_settings"))
    assert [n for n in names if n.endswith(("_kind", "_mode"))] == \
        ["ck_runner_settings_ck_runner_settings_kind", "ck_runner_settings_ck_runner_settings_mode"]
    assert "ck_runner_settings_speculation" in names


def test_the_models_write_and_read_the_new_columns(sessions):
    from app.store.seed import seed_defaults

    with sessions() as s:
        seed_defaults(s)
        model = Model(name="gemma", source="folder")
        s.add(model)
        s.flush()
        s.add(RunnerSettings(model_id=model.id, speculation="ngram-mod"))
        s.add(RequestRecord(arrival_at=utcnow(), class_name="chat", status="ok", draft_tokens=12, draft_accepted=9))
        s.commit()
    with sessions() as s:
        assert {r.name: r.speculation for r in s.query(RequestClass)} == \
            {n: True for n in ("voice", "chat", "documents", "coding", "background")}
        assert s.query(RunnerSettings).one().speculation == "ngram-mod"
        assert (s.query(RequestRecord).one().draft_tokens, s.query(RequestRecord).one().draft_accepted) == (12, 9)


def test_a_class_switched_off_stays_off(engine):
    with Session(engine) as s:
        s.add(RequestClass(name="kitchen", priority=1, ttft_target_ms=1, tpot_target_ms=1, default_max_tokens=1,
                           max_output_tokens=1, max_concurrent=1, max_queue=1, weight=1.0, preemptible=False,
                           queue_timeout_s=1.0, speculation=False))
        s.commit()
    with engine.connect() as connection:
        assert connection.execute(text("SELECT speculation FROM request_classes WHERE name = 'kitchen'")).scalar() == 0


def test_hearth_classes_set_and_list_the_speculation_switch(tmp_path, monkeypatch, standin_model, capsys):
    import sqlite3

    from app.cli import main

    monkeypatch.setenv("HEARTH_DATA", str(tmp_path))
    monkeypatch.setenv("HEARTH_DEFAULT_MODEL", str(standin_model))
    monkeypatch.setenv("HEARTH_MODELS_DIR", str(tmp_path / "models"))
    (tmp_path / "models").mkdir()
    assert main(["classes", "set", "background", "speculation=off"]) == 0
    with sqlite3.connect(tmp_path / "hearth.db") as con:
        assert con.execute("SELECT name FROM request_classes WHERE NOT speculation").fetchall() == [("background",)]
    assert main(["classes", "set", "chat", "speculation=sometimes"]) == 2
    assert "'sometimes' is not a valid speculation: enter yes or no" in capsys.readouterr().err
    assert main(["classes", "list"]) == 0
    lines = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()}
    assert lines["class"].endswith(" drafts private  model")
    assert lines["background"].split()[-4:] == ["no", "no", "(household", "default)"]
    assert lines["chat"].split()[-4:] == ["yes", "no", "(household", "default)"]
