"""`hearth token create --manage|--trust-user-headers`, `hearth token set` and `hearth token member` against a real
store in a temporary data folder."""

import sqlite3

import pytest

from app.cli import main


@pytest.fixture()
def data(tmp_path, monkeypatch):
    monkeypatch.setenv("HEARTH_DATA", str(tmp_path))
    return tmp_path


def query(data, sql):
    with sqlite3.connect(data / "hearth.db") as db:
        return db.execute(sql).fetchall()


def test_permissions_are_off_unless_asked_for_and_set_changes_them(data, capsys):
    assert main(["token", "create", "--member", "alice", "--class", "chat"]) == 0
    assert main(["token", "create", "--member", "openwebui", "--class", "chat", "--trust-user-headers"]) == 0
    assert "names the people behind it" in capsys.readouterr().err
    assert query(data, "select may_manage, trust_user_headers from api_tokens order by id") == [(0, 0), (0, 1)]
    assert main(["token", "set", "1", "--manage"]) == 0
    assert "may manage models" in capsys.readouterr().out
    assert main(["token", "list"]) == 0
    listed = capsys.readouterr().out.splitlines()
    assert listed[0].endswith("permissions") and listed[1].endswith("names-users") and listed[2].endswith("manage")
    assert main(["token", "set", "1", "--no-manage"]) == 0
    assert query(data, "select may_manage from api_tokens where id = 1") == [(0,)]
    assert main(["token", "set", "1"]) == 2
    assert "say what to change" in capsys.readouterr().err
    assert main(["token", "set", "99", "--manage"]) == 2


def test_member_limits_are_shown_set_and_cleared(data, capsys):
    assert main(["token", "create", "--member", "kid", "--class", "voice"]) == 0
    capsys.readouterr()
    assert main(["token", "member", "kid"]) == 0
    shown = capsys.readouterr().out
    assert "max_concurrent         default (0.5 of each class's, setting member_class_share)" in shown
    assert "max_tokens_per_day     default (no limit, setting member_max_tokens_per_day)" in shown
    assert main(["token", "member", "kid", "--max-concurrent", "1", "--max-tokens-per-day", "20000"]) == 0
    assert "max_tokens_per_day     20000" in capsys.readouterr().out
    assert query(data, "select max_concurrent, max_tokens_per_day from members") == [(1, 20000)]
    assert main(["token", "member", "kid", "--max-concurrent", "default"]) == 0
    assert query(data, "select max_concurrent, max_tokens_per_day from members") == [(None, 20000)]
    assert main(["token", "member", "kid", "--max-queue", "-1"]) == 2
    assert "max_queue must be 0 to" in capsys.readouterr().err
    assert main(["token", "member", "nobody"]) == 2
    assert "no member 'nobody' (known: kid)" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="takes a whole number or 'default'"):
        main(["token", "member", "kid", "--max-queue", "lots"])
