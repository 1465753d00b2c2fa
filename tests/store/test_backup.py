"""Backups taken while the writer thread is writing restore to a sound, complete store."""

import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time

import pytest

from app.store.backup import BackupError, backup, restore
from app.store.db import open_store
from app.store.models import RequestRecord, utcnow
from app.store.writer import StoreWriter
from tests.helpers import ServeStarter, query, wait_until


def committed(db_path) -> int:
    """Rows of the requests table another connection sees."""
    return query(db_path, "select count(*) from requests")[0][0]


def test_backup_during_writes_restores_to_a_sound_store(tmp_path):
    data = tmp_path / "data"
    engine, sessions = open_store(data)
    writer = StoreWriter(engine)
    writer.start()
    stop = threading.Event()

    def write():
        i = 0
        while not stop.is_set():
            writer.add(RequestRecord(arrival_at=utcnow(), class_name="chat", status="ok", stream=False,
                                     num_preemptions=0, completion_tokens=i))
            i += 1
            time.sleep(0.0005)

    t = threading.Thread(target=write)
    t.start()
    wait_until(lambda: committed(data / "hearth.db") > 0, 10, "the writer committed nothing")
    size = backup(data, tmp_path / "copy.db")
    copied = committed(tmp_path / "copy.db")
    # Rows keep arriving after the copy: the live store outgrows it.
    wait_until(lambda: committed(data / "hearth.db") > copied, 10, "nothing was written after the backup")
    stop.set()
    t.join()
    writer.stop(5)
    engine.dispose()
    assert size > 0
    with sqlite3.connect(tmp_path / "copy.db") as db:
        assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        copied = db.execute("select count(*) from requests").fetchone()[0]
    with sqlite3.connect(data / "hearth.db") as db:
        live = db.execute("select count(*) from requests").fetchone()[0]
    assert 0 < copied < live  # a consistent earlier state, taken while rows kept arriving

    restore(data, tmp_path / "copy.db")
    with sqlite3.connect(data / "hearth.db") as db:
        assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        assert db.execute("select count(*) from requests").fetchone()[0] == copied
    assert (data / "hearth.db.before-restore").exists()
    open_store(data)[0].dispose()  # still migrates and opens


def test_refusals_are_clear(tmp_path):
    data = tmp_path / "data"
    with pytest.raises(BackupError, match="nothing to back up"):
        backup(data, tmp_path / "x.db")
    engine, _ = open_store(data)
    engine.dispose()
    backup(data, tmp_path / "x.db")
    with pytest.raises(BackupError, match="already exists"):
        backup(data, tmp_path / "x.db")
    (tmp_path / "junk.db").write_bytes(b"not sqlite at all" * 100)
    with pytest.raises(BackupError):
        restore(data, tmp_path / "junk.db")
    other = tmp_path / "other.db"
    with sqlite3.connect(other) as db:
        db.execute("create table t (x)")
    with pytest.raises(BackupError, match="not a Hearth store"):
        restore(data, other)
    # While something holds a write transaction on the store, restore refuses.
    holder = sqlite3.connect(data / "hearth.db")
    holder.execute("BEGIN IMMEDIATE")
    try:
        with pytest.raises(BackupError, match="stop `hearth serve`"):
            restore(data, tmp_path / "x.db")
    finally:
        holder.rollback()
        holder.close()


def hearth_restore(data, backup_file) -> subprocess.CompletedProcess:
    """`hearth restore FILE` as the admin types it, on the data folder `data`."""
    return subprocess.run([sys.executable, "-m", "app.cli", "restore", str(backup_file)], capture_output=True,
                          text=True, env={**os.environ, "HEARTH_DATA": str(data)}, timeout=60)


def test_restore_is_refused_while_serve_runs_and_works_after_it_stops(tmp_path_factory, standin_model):
    starter = ServeStarter(tmp_path_factory.mktemp, standin_model)
    try:
        served = starter()
        data, db_file = served.data, served.data / "hearth.db"
        assert backup(data, data.parent / "copy.db") > 0
        before = db_file.stat().st_ino
        refused = hearth_restore(data, data.parent / "copy.db")
        assert refused.returncode != 0
        assert "stop `hearth serve`" in refused.stderr
        # Nothing changed: the same file is still the live store, nothing set aside, serve still answers.
        assert db_file.stat().st_ino == before and not (data / "hearth.db.before-restore").exists()
        assert served.client.get("/healthz").status_code == 200
        served.stop()
        restored = hearth_restore(data, data.parent / "copy.db")
        assert restored.returncode == 0, restored.stderr
        assert db_file.stat().st_ino != before and (data / "hearth.db.before-restore").exists()
    finally:
        starter.stop_all()


def test_a_crashed_serve_leaves_no_lock_behind(tmp_path):
    """flock dies with its process: a lock file left by a killed serve does not block a restore."""
    data = tmp_path / "data"
    engine, _ = open_store(data)
    engine.dispose()
    backup(data, tmp_path / "copy.db")
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from app.store.db import hold_store; "
                               "held = hold_store(sys.argv[1]); print('held', flush=True); time.sleep(600)", str(data)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        assert hearth_restore(data, tmp_path / "copy.db").returncode != 0
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
        holder.stdout.close()
    assert (data / "hearth.db.lock").exists()
    assert hearth_restore(data, tmp_path / "copy.db").returncode == 0
