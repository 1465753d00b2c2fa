"""A real `hearth serve` on loopback with real runners on the real Gemma GGUF, plus tokens."""

import shutil

import pytest

from app.devtools.serve_process import ServeProcess, prepare_data


@pytest.fixture(scope="session")
def models_dir(tmp_path_factory, gemma_path):
    """A models folder holding a second model (a copy of Gemma under another name) and a broken file."""
    d = tmp_path_factory.mktemp("models")
    # A copy, not a link: the catalog lists one file once, however many names it has.
    shutil.copyfile(gemma_path, d / "gemma-b.gguf")
    (d / "notes.gguf").write_bytes(b"not a model at all" * 10)
    return d


@pytest.fixture(scope="session")
def serve(tmp_path_factory, gemma_path, models_dir):
    """The shared serve: small runners, a tight 'coding' class for queue tests, tokens."""
    data = tmp_path_factory.mktemp("serve-data")
    tokens = prepare_data(
        data,
        classes={"coding": {"max_concurrent": 1, "max_queue": 1, "queue_timeout_s": 60},
                 "documents": {"max_concurrent": 1, "max_queue": 4, "queue_timeout_s": 0.5}},
        settings={"runner_ctx": 1024, "runner_parallel": 4, "runner_threads": 2},
        tokens=[("alice", "chat", ["voice", "coding", "documents"]), ("kid", "voice", [])],
    )
    s = ServeProcess(data, models_dir, gemma_path, data / "serve.log")
    s.tokens = tokens
    yield s
    s.stop()
