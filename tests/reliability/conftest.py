"""The reliability suites' shared `hearth serve` (real runners on the real Gemma GGUF), a tmpfs and a disk filler."""

import errno
import os
import subprocess
from pathlib import Path

import pytest

DEFAULT_MODEL = "gemma-3-270m-q4_k_m"
N_CTX = 1024


@pytest.fixture(scope="session")
def serve(start_shared_serve, models_dir):
    """The shared serve: small runners, tokens for a grown-up (chat, may use voice) and a kid (voice only)."""
    s = start_shared_serve(models_dir, settings={"runner_ctx": N_CTX, "runner_parallel": 4, "runner_threads": 2})
    yield s
    s.stop()


def _fill(folder: Path) -> Path:
    """Write a file until the file system is full; returns it (delete it to free the space)."""
    filler = folder / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    try:
        # Ever smaller writes, so the last partial block is taken too.
        for chunk in (1 << 20, 1 << 16, 1 << 12, 1 << 9):
            try:
                while True:
                    os.write(fd, b"\0" * chunk)
            except OSError as exc:
                assert exc.errno == errno.ENOSPC
    finally:
        os.close(fd)
    return filler


@pytest.fixture
def tmpfs(tmp_path):
    """Factory: a tmpfs of `size` mounted at a fresh folder (skips when mounting is not permitted)."""
    mounts = []

    def mount(name: str, size: str) -> Path:
        where = tmp_path / name
        where.mkdir()
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                              check=False, capture_output=True, text=True)
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
        mounts.append(where)
        return where

    yield mount
    for where in mounts:
        subprocess.run(["umount", "-l", str(where)], check=False, capture_output=True)


@pytest.fixture
def fill_disk():
    """fill(folder): write a file until its file system is full; returns the file (delete it to free)."""
    return _fill
