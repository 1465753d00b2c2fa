"""app.paths and the writers that use it: every file Hearth writes that holds the household's words or secrets
is owner-only (0600 files, 0700 folders) whatever the umask, and `hearth serve` mends what it finds open."""

from __future__ import annotations

import logging
import os
import stat

import pytest
from sqlalchemy import text

from app.paths import mend_private
from app.secrets import secret, secrets_dir, write_secret
from app.serve import check_private_files
from app.store.backup import backup, restore
from app.store.db import open_store


def mode(path) -> int:
    """The permission bits of a path."""
    return stat.S_IMODE(os.lstat(path).st_mode)


@pytest.fixture(autouse=True)
def open_umask():
    """The usual umask (0022), under which a plain open() makes files every local user can read."""
    old = os.umask(0o022)
    yield
    os.umask(old)


def test_the_store_and_its_wal_and_shm_files_are_owner_only(tmp_path):
    data = tmp_path / "data"
    engine, sessions = open_store(data)
    try:
        with sessions() as s:
            s.execute(text("UPDATE settings SET value = value"))
            s.commit()
        for name in ("hearth.db", "hearth.db-wal", "hearth.db-shm"):
            assert (data / name).exists(), name
            assert mode(data / name) == 0o600, name
        assert mode(data) == 0o700
    finally:
        engine.dispose()


def test_a_backup_and_a_restored_store_are_owner_only(tmp_path):
    data = tmp_path / "data"
    engine, _ = open_store(data)
    engine.dispose()
    target = tmp_path / "elsewhere" / "copy.db"
    target.parent.mkdir()
    backup(data, target)
    assert mode(target) == 0o600
    restore(data, target)
    assert mode(data / "hearth.db") == 0o600
    assert mode(data / "hearth.db.before-restore") == 0o600


def test_secrets_are_owner_only_even_in_a_folder_made_open_before(tmp_path):
    (tmp_path / "secrets").mkdir(mode=0o755)
    os.chmod(tmp_path / "secrets", 0o755)
    write_secret(tmp_path, "admin_password", "hash")
    secret(tmp_path, "session_key")
    assert mode(secrets_dir(tmp_path)) == 0o700
    assert mode(tmp_path / "secrets" / "admin_password") == 0o600
    assert mode(tmp_path / "secrets" / "session_key") == 0o600


def test_serve_s_start_check_mends_open_files_with_a_warning(tmp_path, caplog):
    data = tmp_path / "data"
    data.mkdir(mode=0o755)
    os.chmod(data, 0o755)
    (data / "hearth.db").write_bytes(b"")
    (data / "hearth.db-wal").write_bytes(b"")
    kv = data / "kv-cache" / "0123abcd"
    kv.mkdir(parents=True)
    (kv / "f00d.kv").write_bytes(b"HEARTHKV1\n")
    (data / "secrets").mkdir()
    (data / "secrets" / "admin_password").write_text("hash")
    models = data / "models"
    models.mkdir()
    (models / "gemma.gguf").write_bytes(b"GGUF")  # the assembled default model: a public file, left alone
    (data / "elsewhere").symlink_to(tmp_path)
    outside = mode(tmp_path)
    with caplog.at_level(logging.WARNING, logger="app.serve"):
        lines = check_private_files(data)
    private = [data, data / "hearth.db", data / "hearth.db-wal", data / "kv-cache", kv, kv / "f00d.kv",
               data / "secrets", data / "secrets" / "admin_password"]
    assert len(lines) == len(private)
    for path in private:
        assert mode(path) == (0o700 if path.is_dir() else 0o600), path
        assert str(path) in caplog.text
    assert "readable by other users" in caplog.text and "now owner-only" in caplog.text
    assert mode(models / "gemma.gguf") == 0o644
    assert mode(tmp_path) == outside  # a link is never followed out of the data folder
    assert mend_private(data) == []  # mended once: the next start finds nothing


def test_a_folder_this_user_may_not_change_is_reported_and_serve_starts(tmp_path, monkeypatch, caplog):
    """TrueNAS runs apps as uid 568 on a dataset root owns, shared by an ACL: chmod is refused there."""
    data = tmp_path / "data"
    data.mkdir(mode=0o755)
    os.chmod(data, 0o755)
    real = os.chmod

    def chmod(path, mode, **kwargs):
        if os.fspath(path) == os.fspath(data):
            raise PermissionError(1, "Operation not permitted")
        return real(path, mode, **kwargs)

    monkeypatch.setattr(os, "chmod", chmod)
    with caplog.at_level(logging.WARNING, logger="app.serve"):
        lines = check_private_files(data)
    engine, _ = open_store(data)  # the store still opens, owner-only itself
    engine.dispose()
    assert mode(data / "hearth.db") == 0o600
    assert lines == [f"{data} is readable by other users of this machine (mode 0755) and this user (uid {os.getuid()}) "
                     "may not change it: it holds the household's words or secrets; make it owner-only (chmod 700) "
                     "as its owner"]
    assert lines[0] in caplog.text
