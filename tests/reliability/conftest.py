"""A real `hearth serve` on the real Gemma GGUF for the reliability suites, plus its runner's URL."""

import shutil

import pytest

from app.bench.serve_process import ServeProcess, prepare_data

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
