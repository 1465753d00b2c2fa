"""Fixtures for the appliance tests: folders and ids for a throwaway unprivileged user, the container engine."""

import os
import shutil
import sys
import sysconfig
import tempfile
from pathlib import Path

import pytest


@pytest.fixture
def open_tmp():
    """A temporary folder every user can traverse (pytest's own tmp_path is private to its owner)."""
    path = Path(tempfile.mkdtemp(prefix="hearth-appliance-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def throwaway_ids():
    """A PUID/PGID pair no account uses on these machines."""
    return 12345, 12346


def _world_reachable(path: Path) -> bool:
    """Whether every folder above path lets any user through and path itself is world-executable."""
    path = path.resolve()
    return all(p.stat().st_mode & 0o001 for p in [path, *path.parents])


@pytest.fixture
def unprivileged_env(open_tmp):
    """PATH and PYTHONPATH under which any user runs this venv's Python and a `hearth` command.

    The venv's interpreter may live in a private folder (pyenv under /root); a system Python of the
    same minor version then runs the venv's packages, as the container's user would.
    """
    python = Path(sys.executable)
    if not _world_reachable(python):
        python = Path(f"/usr/bin/python{sys.version_info.major}.{sys.version_info.minor}")
        if not python.exists() or not _world_reachable(python):
            pytest.skip(f"no Python {sys.version_info.major}.{sys.version_info.minor} that other users can run")
    bin_dir = open_tmp / "bin"
    bin_dir.mkdir()
    (bin_dir / "python").symlink_to(python)
    hearth = bin_dir / "hearth"
    hearth.write_text(f'#!/bin/sh\nexec {python} -m app.cli "$@"\n')
    hearth.chmod(0o755)
    repo = Path(__file__).resolve().parents[2]
    return {"PATH": f"{bin_dir}:/usr/bin:/bin",
            "PYTHONPATH": f"{repo}:{sysconfig.get_paths()['purelib']}",
            "HOME": str(open_tmp)}


@pytest.fixture(scope="session")
def engine_bases():
    """For the container tier: a running engine (started if none runs) and the base-image build arguments (the local
    stand-ins where the hub cannot be reached). Root only: the tier starts dockerd and chowns ./data."""
    from app.devtools import container as engine

    if os.geteuid() != 0:
        pytest.skip("the container tier runs as root (it starts dockerd and chowns ./data)")
    try:
        engine.ensure_engine()
        return engine.base_image_args(log=lambda line: print(f"[container] {line}"))
    except engine.EngineUnavailable as exc:
        pytest.fail(f"the container tier needs an engine: {exc}")
