"""Where Hearth keeps things: the data folder, the models folder; file hashing; owner-only files.

The data folder holds the family's words and secrets (the store and its request log, the KV disk tier's
saved prompts, the admin's password hash and session key), so what Hearth writes there is owner-only:
folders 0700, files 0600, set when written whatever the umask, and mended at every start (`mend_private`)
for folders an older Hearth, a copy or a restore left open.
"""

from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path

PRIVATE_DIR_MODE = 0o700
PRIVATE_FILE_MODE = 0o600
# The data folder's entries that hold a family's words or secrets, walked by mend_private: the store (its
# WAL and shared-memory sidecars, the copy a restore keeps), the secrets, the KV disk tier (app.residency.supervisor
# the kv-cache folder), the serving lock. The assembled default model is a public file and is left as it is.
DATABASE_NAME = "hearth.db"
KV_CACHE_DIR = "kv-cache"
SECRETS_DIR = "secrets"
PRIVATE_ENTRIES = (DATABASE_NAME, f"{DATABASE_NAME}-wal", f"{DATABASE_NAME}-shm", f"{DATABASE_NAME}.before-restore",
                   f"{DATABASE_NAME}.restoring", f"{DATABASE_NAME}.lock", SECRETS_DIR, KV_CACHE_DIR)


def data_dir() -> Path:
    """Returns Hearth's data folder ($HEARTH_DATA or ~/.local/share/hearth), created owner-only."""
    configured = os.environ.get("HEARTH_DATA")
    path = Path(configured).expanduser() if configured else Path.home() / ".local/share/hearth"
    return private_dir(path)


def private_dir(path: str | os.PathLike) -> Path:
    """Create a folder (and its missing parents) and make it owner-only (0700); returns it."""
    path = Path(path)
    path.mkdir(mode=PRIVATE_DIR_MODE, parents=True, exist_ok=True)
    if stat.S_IMODE(path.stat().st_mode) != PRIVATE_DIR_MODE:
        _chmod(path, PRIVATE_DIR_MODE)
    return path


def _chmod(path: str | os.PathLike | int, mode: int) -> bool:
    """chmod (or fchmod, given a descriptor); False where this user may not (a folder another user owns, shared by
    an ACL: TrueNAS runs apps as 568 on a dataset root owns), which serve's start check reports."""
    try:
        os.fchmod(path, mode) if isinstance(path, int) else os.chmod(path, mode)
        return True
    except PermissionError:
        return False


def private_file(path: str | os.PathLike) -> None:
    """Make an existing file owner-only (0600), where this user may."""
    _chmod(path, PRIVATE_FILE_MODE)


def open_private(path: str | os.PathLike, mode: str = "wb"):
    """Open a file for writing, created owner-only (0600) whatever the umask; an existing one is made so."""
    flags = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if "a" in mode else os.O_TRUNC)
    fd = os.open(path, flags, PRIVATE_FILE_MODE)
    try:
        _chmod(fd, PRIVATE_FILE_MODE)
        return os.fdopen(fd, mode)
    except BaseException:
        os.close(fd)
        raise


def mend_private(data: str | os.PathLike) -> list[tuple[Path, int]]:
    """Make the data folder and its private entries owner-only; returns each path found open with its old mode
    (still open afterwards where this user may not change it: see `private_mode`)."""
    mended = []

    def mend(path: Path, wanted: int) -> None:
        try:
            st = path.lstat()
        except FileNotFoundError:
            return
        if stat.S_ISLNK(st.st_mode):
            return  # never follow a link out of the data folder
        old = stat.S_IMODE(st.st_mode)
        if old != wanted:
            _chmod(path, wanted)
            mended.append((path, old))

    root = Path(data)
    mend(root, PRIVATE_DIR_MODE)
    for name in PRIVATE_ENTRIES:
        top = root / name
        if top.is_dir() and not top.is_symlink():
            mend(top, PRIVATE_DIR_MODE)
            for folder, dirs, files in os.walk(top):
                for d in dirs:
                    mend(Path(folder) / d, PRIVATE_DIR_MODE)
                for f in files:
                    mend(Path(folder) / f, PRIVATE_FILE_MODE)
        else:
            mend(top, PRIVATE_FILE_MODE)
    return mended


def private_mode(path: Path) -> bool:
    """True when a path is owner-only (nothing for the group or others)."""
    return not path.lstat().st_mode & 0o077


def sha256_of(path: str | os.PathLike) -> str:
    """sha256 of a file, read in 4 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(4 * 1024 * 1024), b""):
            h.update(block)
    return h.hexdigest()
