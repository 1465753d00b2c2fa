"""Fixtures shared by every test package."""

import shutil

import pytest

from app.residency.default_model import ensure_default_model


@pytest.fixture(scope="session")
def gemma_path(tmp_path_factory):
    """The embedded Gemma 3 270M GGUF, assembled once for the whole session."""
    data_dir = tmp_path_factory.mktemp("hearth-data")
    yield ensure_default_model(data_dir, progress=False)
    # 250 MB per run would pile up in pytest's kept temp folders.
    shutil.rmtree(data_dir / "models")
