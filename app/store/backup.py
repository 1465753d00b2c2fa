"""`hearth backup FILE` / `hearth restore FILE`: consistent copies of the store, taken while serving."""

from __future__ import annotations

import os
import sqlite3
from contextlib import closing
from dataclasses import dataclass, field
from pathlib import Path

from app.store.db import StoreInUse, create_private, database_path, hold_store_exclusively
from app.store.models import utcnow


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
    # The copy holds the request log and the tokens' hashes: owner-only, wherever it is written.
    create_private(tmp)
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


@dataclass(frozen=True)
class TokenRow:
    """One API token as a store holds it (never the token itself: its id, prefix and member)."""

    id: int
    prefix: str
    member: str
    token_hash: str
    revoked_at: str | None

    def describe(self) -> str:
        """'token 3 (hth_ab12cd…) of alice', as `hearth token list` names it."""
        return f"token {self.id} ({self.prefix}…) of {self.member}"


@dataclass(frozen=True)
class RestoreReport:
    """What a restore did: where the store is, and the tokens the backup would have brought back to life."""

    source: Path
    live: Path
    # Live in the backup, revoked (or gone) in the store it replaced: kept revoked unless revived.
    kept_revoked: list[TokenRow] = field(default_factory=list)
    revived: list[TokenRow] = field(default_factory=list)
    # False when there was no store (or one without tokens) to compare with: the backup's tokens stand as they are.
    compared: bool = True

    def lines(self) -> list[str]:
        """The report as the command line prints it."""
        kept = self.live.name + ".before-restore"
        out = [f"restored {self.source} to {self.live}; the previous store is kept as {kept}"]
        if not self.compared:
            out.append("no earlier tokens to compare with: the backup's tokens are as they were when it was taken")
        elif self.kept_revoked:
            out.append(f"{len(self.kept_revoked)} token(s) live in the backup but revoked or deleted since are kept "
                       "revoked (restore again with --revive-tokens to bring them back):")
            out += [f"  {t.describe()}" for t in self.kept_revoked]
        elif self.revived:
            out.append(f"{len(self.revived)} token(s) revoked or deleted since the backup are live again "
                       "(--revive-tokens); revoke any that should stay off with `hearth token revoke`:")
            out += [f"  {t.describe()}" for t in self.revived]
        else:
            out.append("no token revoked since the backup comes back: every token is as it was before the restore")
        return out


def _tokens(db: sqlite3.Connection) -> list[TokenRow]:
    rows = db.execute("select t.id, t.prefix, coalesce(m.name, '?'), t.token_hash, t.revoked_at from api_tokens t "
                      "left join members m on m.id = t.member_id order by t.id")
    return [TokenRow(*r) for r in rows]


def _store_tokens(path: Path) -> list[TokenRow] | None:
    """The tokens of the store at `path`; None when there is no store, or no token table in it."""
    if not path.exists():
        return None
    with closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as db:
        try:
            return _tokens(db)
        except sqlite3.OperationalError:
            return None


def _revoked_since(before: list[TokenRow] | None, backup: list[TokenRow]) -> list[TokenRow] | None:
    """The backup's live tokens that `before` (the store being replaced) holds revoked or no longer holds."""
    if not before:
        return None
    now = {t.token_hash: t for t in before}
    return [t for t in backup if t.revoked_at is None and (t.token_hash not in now or now[t.token_hash].revoked_at)]


def restore(data_dir: Path, source: Path, revive_tokens: bool = False) -> RestoreReport:
    """Replace the store with a backup (hearth serve must be stopped); the old store is kept beside it.

    A token revoked (or deleted) after the backup was taken stays revoked in the restored store unless
    `revive_tokens`: a restore must not silently let back in a token the admin locked out.
    """
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
        before = _store_tokens(database_path(data_dir))
        live = _swap_in(data_dir, source)
        with closing(sqlite3.connect(live)) as db:
            revived = _revoked_since(before, _tokens(db))
            if revived is None:
                return RestoreReport(source, live, compared=False)
            if not revive_tokens and revived:
                # The time it was revoked, when the replaced store says; a deleted token's is now.
                when = {t.token_hash: t.revoked_at for t in before or ()}
                # SQLAlchemy's own text for a DateTime in SQLite: naive UTC, microseconds.
                now = utcnow().replace(tzinfo=None).isoformat(sep=" ", timespec="microseconds")
                with db:
                    db.executemany("update api_tokens set revoked_at = ? where id = ?",
                                   [(when.get(t.token_hash) or now, t.id) for t in revived])
                return RestoreReport(source, live, kept_revoked=revived)
            return RestoreReport(source, live, revived=revived)
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
    tmp.unlink(missing_ok=True)
    create_private(tmp)
    src = sqlite3.connect(f"file:{source}?mode=ro", uri=True)
    dst = sqlite3.connect(tmp)
    try:
        src.backup(dst)
    finally:
        dst.close()
        src.close()
    os.replace(tmp, live)
    return live
