"""A restore never silently lets back in a token revoked (or deleted) after the backup was taken:
such tokens stay revoked unless the admin asks for them, and `hearth restore` lists them either way."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
from contextlib import closing

from app.gateway.auth import hash_token
from app.gateway.tokens import create_token, revoke_token
from app.store.backup import backup, restore
from app.store.db import open_store
from tests.helpers import query


def make_tokens(data, *members: str) -> dict[str, tuple[str, str]]:
    """member → (token, id), in a fresh store at `data`."""
    engine, sessions = open_store(data)
    out = {}
    with sessions() as s:
        for member in members:
            token, info = create_token(s, member, "chat")
            out[member] = (token, str(info.id))
        s.commit()
    engine.dispose()
    return out


def revoke(data, token_id: str) -> None:
    engine, sessions = open_store(data)
    with sessions() as s:
        revoke_token(s, token_id)
        s.commit()
    engine.dispose()


def revoked(data, token: str):
    """The revoked_at of `token` in the store at `data` (None: live)."""
    (at,), = query(data / "hearth.db", "select revoked_at from api_tokens where token_hash = ?", hash_token(token))
    return at


def hearth_restore(data, backup_file, *flags: str) -> subprocess.CompletedProcess:
    """`hearth restore FILE [flags]` as the admin types it, on the data folder `data`."""
    return subprocess.run([sys.executable, "-m", "app.cli", "restore", str(backup_file), *flags], capture_output=True,
                          text=True, env={**os.environ, "HEARTH_DATA": str(data)}, timeout=60)


def test_tokens_revoked_or_deleted_since_the_backup_stay_revoked_and_are_listed(tmp_path):
    data = tmp_path / "data"
    tokens = make_tokens(data, "alice", "kid", "script", "gone")
    revoke(data, tokens["script"][1])  # revoked before the backup: nothing to say about it
    backup(data, tmp_path / "copy.db")
    revoke(data, tokens["kid"][1])
    when_kid = revoked(data, tokens["kid"][0])
    with closing(sqlite3.connect(data / "hearth.db")) as db, db:
        db.execute("delete from api_tokens where token_hash = ?", (hash_token(tokens["gone"][0]),))

    report = restore(data, tmp_path / "copy.db")

    assert report.compared and not report.revived
    assert sorted(t.member for t in report.kept_revoked) == ["gone", "kid"]
    assert revoked(data, tokens["alice"][0]) is None
    # The time it was revoked is kept; the deleted one is revoked as of the restore.
    assert revoked(data, tokens["kid"][0]) == when_kid
    assert revoked(data, tokens["gone"][0]) is not None and revoked(data, tokens["script"][0]) is not None
    lines = "\n".join(report.lines())
    assert "2 token(s) live in the backup but revoked or deleted since are kept revoked" in lines
    assert "--revive-tokens" in lines and f"token {tokens['kid'][1]} (" in lines and "of kid" in lines
    assert tokens["kid"][0] not in lines  # ids and prefixes only, never a token
    open_store(data)[0].dispose()  # the edited store still migrates and opens


def test_revive_tokens_brings_them_back_and_says_so(tmp_path):
    data = tmp_path / "data"
    tokens = make_tokens(data, "alice", "kid")
    backup(data, tmp_path / "copy.db")
    revoke(data, tokens["kid"][1])
    report = restore(data, tmp_path / "copy.db", revive_tokens=True)
    assert [t.member for t in report.revived] == ["kid"] and not report.kept_revoked
    assert revoked(data, tokens["kid"][0]) is None
    assert "live again (--revive-tokens)" in "\n".join(report.lines())


def test_a_restore_onto_a_store_without_tokens_keeps_the_backups_as_they_were(tmp_path):
    old, new = tmp_path / "old", tmp_path / "new"
    tokens = make_tokens(old, "alice")
    backup(old, tmp_path / "copy.db")
    # A new machine: no store at all, or a store serve made before any token existed.
    for data in (new, tmp_path / "newer"):
        if data == new:
            make_tokens(data)
        report = restore(data, tmp_path / "copy.db")
        assert not report.compared and not report.kept_revoked
        assert revoked(data, tokens["alice"][0]) is None
        assert "no earlier tokens to compare with" in "\n".join(report.lines())


def test_the_command_line_lists_what_it_keeps_revoked_and_what_it_revives(tmp_path):
    data = tmp_path / "data"
    tokens = make_tokens(data, "alice", "kid")
    backup(data, tmp_path / "copy.db")
    revoke(data, tokens["kid"][1])
    kept = hearth_restore(data, tmp_path / "copy.db")
    assert kept.returncode == 0, kept.stderr
    assert f"restored {tmp_path / 'copy.db'} to {data / 'hearth.db'}" in kept.stdout
    assert "1 token(s) live in the backup but revoked or deleted since are kept revoked" in kept.stdout
    assert f"token {tokens['kid'][1]} (" in kept.stdout and revoked(data, tokens["kid"][0]) is not None
    # The store just restored holds kid revoked: nothing more comes back from a second restore…
    again = hearth_restore(data, tmp_path / "copy.db")
    assert "kept revoked" in again.stdout and revoked(data, tokens["kid"][0]) is not None
    # …unless the admin asks for it.
    revived = hearth_restore(data, tmp_path / "copy.db", "--revive-tokens")
    assert revived.returncode == 0, revived.stderr
    assert "1 token(s) revoked or deleted since the backup are live again" in revived.stdout
    assert revoked(data, tokens["kid"][0]) is None
