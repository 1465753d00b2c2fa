"""`hearth backup FILE` / `hearth restore FILE`: consistent copies of the store, taken while serving."""

from __future__ import annotations

import os
import sqlite3
from contextlib import closing
from pathlib import Path

from app.store.db import StoreInUse, database_path, hold_store_exclusively


class BackupError(RuntimeError):
    """A backup or restore that could not be carried out (the message says why)."""


def _integrity(path: Path) -> str:
    """SQLite's integrity_check verdict ("ok" when sound), or why the file could not be checked."""
    try:
        with closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as db:
            return db.execute("PRAGMA integrity_check").fetchone()[0]
    except sqlite3.DatabaseError as exc:
        return str(exc)


def backup(data_dir: Path, target: Path) -> int:
    """Copy the live store to target with SQLite's online backup API; returns the bytes written.

    The backup API copies pages under a read transaction and restarts when a writer changes a page
    it already copied, so the copy is one consistent state even while `hearth serve` writes.
    """
    source = database_path(data_dir)
    if not source.exists():
        raise BackupError(f"no store at {source}: nothing to back up")
    target = Path(target)
    if target.exists():
        raise BackupError(f"{target} already exists; choose a new file name")
    tmp = target.with_name(target.name + ".partial")
    src = sqlite3.connect(source)
    dst = sqlite3.connect(tmp)
    try:
        src.execute("PRAGMA busy_timeout = 5000")
        src.backup(dst, pages=256)
        # A standalone file: no WAL sidecars needed to read it.
        dst.execute("PRAGMA journal_mode = DELETE")
    finally:
        dst.close()
        src.close()
    if (result := _integrity(tmp)) != "ok":
        tmp.unlink()
        raise BackupError(f"the copy failed its integrity check: {result}")
    os.replace(tmp, target)
    return target.stat().st_size


def restore(data_dir: Path, source: Path) -> Path:
    """Replace the store with a backup (hearth serve must be stopped); the old store is kept beside it."""
    source = Path(source)
    if not source.is_file():
        raise BackupError(f"no backup file at {source}")
    if (result := _integrity(source)) != "ok":
        raise BackupError(f"{source} is not a sound SQLite store: {result}")
    with closing(sqlite3.connect(f"file:{source}?mode=ro", uri=True)) as db:
        tables = {r[0] for r in db.execute("select name from sqlite_master where type='table'")}
    if "alembic_version" not in tables or "requests" not in tables:
        raise BackupError(f"{source} is a SQLite file but not a Hearth store (no alembic_version/requests tables)")
    try:
        # Held until the new store is in place: a serve starting meanwhile waits for it.
        held = hold_store_exclusively(data_dir)
    except StoreInUse as exc:
        raise BackupError(f"{exc}: stop `hearth serve` before restoring (nothing was changed)")
    try:
        return _swap_in(data_dir, source)
    finally:
        held.close()


def _swap_in(data_dir: Path, source: Path) -> Path:
    """Put `source` in place of the live store (which is kept beside it); the caller holds the lock."""
    live = database_path(data_dir)
    if live.exists():
        # Another process (a `hearth token` command, say) may be writing without serving.
        probe = sqlite3.connect(live, timeout=0.5)
        try:
            probe.execute("BEGIN EXCLUSIVE")
            probe.execute("ROLLBACK")
        except sqlite3.OperationalError:
            raise BackupError("the store is being written: stop `hearth serve` and other hearth commands before restoring")
        finally:
            probe.close()
        kept = live.with_name(live.name + ".before-restore")
        os.replace(live, kept)
        for suffix in ("-wal", "-shm"):
            Path(str(live) + suffix).unlink(missing_ok=True)
    tmp = live.with_name(live.name + ".restoring")
    src = sqlite3.connect(f"file:{source}?mode=ro", uri=True)
    dst = sqlite3.connect(tmp)
    try:
        src.backup(dst)
    finally:
        dst.close()
        src.close()
    os.replace(tmp, live)
    return live
