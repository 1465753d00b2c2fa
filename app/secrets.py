"""Secrets generated once per data folder (the session key, …), kept in `<data>/secrets/` with mode 0600."""

from __future__ import annotations

import os
import re
import secrets as _random
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

# app.paths (a sibling base module: no import) names this folder too, for the start's permission check.
SECRETS_DIR = "secrets"
_NAME = re.compile(r"^[a-z0-9_]+$")


def secrets_dir(data_dir: Path) -> Path:
    """The folder holding the secrets (created 0700 on first use)."""
    path = Path(data_dir) / SECRETS_DIR
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    if path.stat().st_mode & 0o077:
        try:
            os.chmod(path, 0o700)  # made before by something else, or under another umask
        except PermissionError:
            pass  # another user's folder this one may write (an ACL): serve's start check says so
    return path


def write_secret(data_dir: Path, name: str, value: str) -> None:
    """Store `value` under `name` (mode 0600), replacing it atomically."""
    if not _NAME.match(name):
        raise ValueError(f"secret name {name!r}: use lower-case letters, digits and _")
    folder = secrets_dir(data_dir)
    tmp = folder / f".{name}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)  # a leftover temporary file keeps its mode through O_CREAT
    with os.fdopen(fd, "w") as f:
        f.write(value)
    os.replace(tmp, folder / name)


def create_secret(data_dir: Path, name: str, value: str) -> bool:
    """Store `value` under `name` only if there is none yet; False when one exists.

    Atomic: the value is written to a private file first and then hard-linked into place, and link()
    fails when the name exists, so of any number of concurrent callers exactly one wins and nobody
    ever reads a half-written value.
    """
    if not _NAME.match(name):
        raise ValueError(f"secret name {name!r}: use lower-case letters, digits and _")
    folder = secrets_dir(data_dir)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{name}.")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(value)
        try:
            os.link(tmp, folder / name)
        except FileExistsError:
            return False
        return True
    finally:
        os.unlink(tmp)


def remove_secret(data_dir: Path, name: str) -> None:
    """Delete the secret `name` (nothing happens when there is none)."""
    if not _NAME.match(name):
        raise ValueError(f"secret name {name!r}: use lower-case letters, digits and _")
    (Path(data_dir) / SECRETS_DIR / name).unlink(missing_ok=True)


def read_secret(data_dir: Path, name: str) -> str | None:
    """The stored value, or None when there is none yet."""
    if not _NAME.match(name):
        raise ValueError(f"secret name {name!r}: use lower-case letters, digits and _")
    try:
        return (Path(data_dir) / SECRETS_DIR / name).read_text().strip() or None
    except FileNotFoundError:
        return None


def secret(data_dir: Path, name: str, generate: Callable[[], str] = lambda: _random.token_urlsafe(32)) -> str:
    """The secret `name`: generated once (by `generate`), reused by every later call and process."""
    existing = read_secret(data_dir, name)
    if existing:
        return existing
    path = secrets_dir(data_dir) / name
    try:
        # O_EXCL: when two processes start at once, one writes and both read the same value.
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        # The other process may not have written yet: wait briefly for its value.
        for _ in range(200):
            value = path.read_text().strip()
            if value:
                return value
            time.sleep(0.01)
        raise RuntimeError(f"{path} exists but stays empty: delete it and restart")
    with os.fdopen(fd, "w") as f:
        f.write(generate())
    return path.read_text().strip()
