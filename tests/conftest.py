"""Fixtures shared by every test package."""

import shutil

import pytest

from app.residency.default_model import ensure_default_model
from app.store.db import database_path, make_engine, session_factory, upgrade


@pytest.fixture(scope="session")
def gemma_path(tmp_path_factory):
    """The embedded Gemma 3 270M GGUF, assembled once for the whole session."""
    data_dir = tmp_path_factory.mktemp("hearth-data")
    yield ensure_default_model(data_dir, progress=False)
    # 250 MB per run would pile up in pytest's kept temp folders.
    shutil.rmtree(data_dir / "models")


# A fresh SQLite store per test, in the test's temporary folder.
@pytest.fixture
def make_store(tmp_path):
    """Factory: an engine on the test's database file, migrated to `revision` (None: left as is)."""
    engines = []

    def make(revision="head", **engine_options):
        engine = make_engine(database_path(tmp_path), **engine_options)
        engines.append(engine)
        if revision is not None:
            upgrade(engine, revision)
        return engine

    yield make
    for engine in engines:
        engine.dispose()


@pytest.fixture
def engine(make_store):
    """An engine on a store migrated to head."""
    return make_store()


@pytest.fixture
def sessions(engine):
    """Sessions on the `engine` store."""
    return session_factory(engine)
