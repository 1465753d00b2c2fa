"""A request class's thinking default in the store: migration 0012 and the seeded classes (voice off)."""

from __future__ import annotations

from sqlalchemy import inspect, text

from app.store import db
from app.store.seed import DEFAULT_CLASSES

CLASS_ROW = ("INSERT INTO request_classes (name, priority, ttft_target_ms, tpot_target_ms, default_max_tokens, "
             "max_output_tokens, max_concurrent, max_queue, weight, preemptible, queue_timeout_s) "
             "VALUES (:name, 1, 500, 100, 128, 256, 4, 8, 1.0, 0, 10.0)")


def test_0012_turns_voice_off_and_leaves_the_others_to_the_model(make_store):
    engine = make_store(revision="0011")
    with engine.begin() as connection:
        for name in ("voice", "chat", "kitchen"):
            connection.execute(text(CLASS_ROW), {"name": name})
    db.upgrade(engine)
    with engine.connect() as connection:
        rows = dict(connection.execute(text("SELECT name, thinking FROM request_classes")).all())
    assert rows == {"voice": "off", "chat": "model", "kitchen": "model"}
    db.downgrade(engine, "0011")
    assert "thinking" not in {c["name"] for c in inspect(engine).get_columns("request_classes")}


def test_a_new_store_seeds_voice_without_thinking(engine):
    from sqlalchemy.orm import Session

    from app.store.models import RequestClass
    from app.store.seed import seed_defaults

    with Session(engine) as s:
        seed_defaults(s)
        s.commit()
        stored = {r.name: r.thinking for r in s.query(RequestClass)}
    assert stored == {c["name"]: c["thinking"] for c in DEFAULT_CLASSES}
    assert stored["voice"] == "off" and set(stored.values()) == {"off", "model"}


def test_hearth_classes_set_and_list_the_thinking_default(tmp_path, monkeypatch, standin_model, capsys):
    import sqlite3

    from app.cli import main

    monkeypatch.setenv("HEARTH_DATA", str(tmp_path))
    monkeypatch.setenv("HEARTH_DEFAULT_MODEL", str(standin_model))
    monkeypatch.setenv("HEARTH_MODELS_DIR", str(tmp_path / "models"))
    (tmp_path / "models").mkdir()
    assert main(["classes", "set", "chat", "thinking=ON"]) == 0
    with sqlite3.connect(tmp_path / "hearth.db") as con:
        assert con.execute("SELECT thinking FROM request_classes WHERE name = 'chat'").fetchall() == [("on",)]
    assert main(["classes", "set", "chat", "thinking=maybe"]) == 2
    assert "'maybe' is not a valid thinking: enter one of model, off, on" in capsys.readouterr().err
    assert main(["classes", "list"]) == 0
    lines = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()}
    assert "thinking" in lines["class"] and " on " in lines["chat"] and " off " in lines["voice"]
