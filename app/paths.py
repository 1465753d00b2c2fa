"""Where Hearth keeps things: the data folder, the models folder; file hashing."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def data_dir() -> Path:
    """Returns Hearth's data folder ($HEARTH_DATA or ~/.local/share/hearth), created."""
    configured = os.environ.get("HEARTH_DATA")
    path = Path(configured).expanduser() if configured else Path.home() / ".local/share/hearth"
    path.mkdir(parents=True, exist_ok=True)
    return path


def sha256_of(path: str | os.PathLike) -> str:
    """sha256 of a file, read in 4 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(4 * 1024 * 1024), b""):
            h.update(block)
    return h.hexdigest()
