"""Whose request it is and whether its class is private reach the runner with every generation (a stand-in runner
on loopback keeps the bodies): the gateway sets hearth_member and hearth_private itself, whatever the client sent,
and a class marked private (the Classes page, `hearth classes set NAME private=yes`) says so."""

from __future__ import annotations

import sqlite3

import pytest
from test_speculation_relay import CHAT, StandIn, _switch, gateway, standin  # noqa: F401  (fixtures)

from app.admin import update_class
from app.cli import main
from app.gateway.context import services


def _private(app, name: str, on: bool) -> None:
    svc = services(app)
    with svc.sessions() as s:
        update_class(s, name, {"private": "yes" if on else "no"})
        s.commit()
    svc.classes.invalidate()


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", CHAT),
    ("/v1/completions", {"prompt": "Once upon a time"}),
    ("/api/chat", {**CHAT, "stream": False}),
])
def test_the_runner_hears_whose_request_it_is_and_whether_its_class_is_private(gateway, path, body):  # noqa: F811
    app, auth, _ = gateway
    client = app.test_client()
    body = {**body, "model": services(app).catalog.default_model_name()}
    assert client.post(path, headers=auth, json=body).status_code == 200
    assert StandIn.bodies[-1]["hearth_member"] == "alice" and StandIn.bodies[-1]["hearth_private"] is False
    _private(app, "chat", on=True)
    assert client.post(path, headers=auth, json=body).status_code == 200
    assert StandIn.bodies[-1]["hearth_private"] is True
    assert client.post(path, headers={**auth, "X-Hearth-Class": "voice"}, json=body).status_code == 200
    assert StandIn.bodies[-1]["hearth_private"] is False  # another class of the same token


def test_a_client_cannot_speak_for_another_member_or_unmark_a_private_class(gateway):  # noqa: F811
    app, auth, _ = gateway
    _private(app, "chat", on=True)
    r = app.test_client().post("/v1/chat/completions", headers=auth,
                               json={**CHAT, "hearth_member": "bob", "hearth_private": False})
    assert r.status_code == 200
    assert StandIn.bodies[-1]["hearth_member"] == "alice" and StandIn.bodies[-1]["hearth_private"] is True


def test_hearth_classes_set_marks_a_class_private(tmp_path, monkeypatch, capsys, standin_model):
    monkeypatch.setenv("HEARTH_DATA", str(tmp_path))
    monkeypatch.setenv("HEARTH_DEFAULT_MODEL", str(standin_model))
    monkeypatch.setenv("HEARTH_MODELS_DIR", str(tmp_path / "models"))
    (tmp_path / "models").mkdir()
    assert main(["classes", "set", "chat", "private=yes"]) == 0
    with sqlite3.connect(tmp_path / "hearth.db") as con:
        assert con.execute("SELECT name FROM request_classes WHERE private").fetchall() == [("chat",)]
    assert main(["classes", "list"]) == 0
    lines = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()}
    assert lines["chat"].split()[-3] == "yes" and lines["voice"].split()[-3] == "no"
