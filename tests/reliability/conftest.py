"""A real `hearth serve` on the real Gemma GGUF for the reliability suites, plus its runner's URL."""

import errno
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from app.devtools.serve_process import ServeProcess, prepare_data

DEFAULT_MODEL = "gemma-3-270m-q4_k_m"
N_CTX = 1024


@pytest.fixture(scope="session")
def models_dir(tmp_path_factory, gemma_path):
    """A models folder with one servable copy of Gemma and one file that is not a model."""
    d = tmp_path_factory.mktemp("rel-models")
    shutil.copyfile(gemma_path, d / "gemma-b.gguf")
    (d / "notes.gguf").write_bytes(b"not a model at all" * 10)
    return d


@pytest.fixture(scope="session")
def serve(tmp_path_factory, gemma_path, models_dir):
    """The shared serve: small runners, tokens for a grown-up (chat, may use voice) and a kid (voice only)."""
    data = tmp_path_factory.mktemp("rel-serve-data")
    tokens = prepare_data(
        data,
        settings={"runner_ctx": N_CTX, "runner_parallel": 4, "runner_threads": 2},
        tokens=[("alice", "chat", ["voice"]), ("kid", "voice", [])],
    )
    s = ServeProcess(data, models_dir, gemma_path, data / "serve.log")
    s.tokens = tokens
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
