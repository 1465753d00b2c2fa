"""Routing: catalog and residency errors become the gateway's HTTP errors, here and nowhere else."""

import pytest

from app.gateway.classes import ClassRegistry
from app.gateway.routing import Router
from app.protocols.openai import ApiError
from app.residency.manager import ModelLoadFailed, NotEnoughMemory, UnknownModel
from app.services.catalog import Catalog
from app.services.settings import SettingsCache
from app.store.db import open_store


class _Residency:
    """Raises what a real residency manager raises for a model it cannot serve."""

    def __init__(self, error=None):
        self.error = error

    def acquire(self, name):
        raise self.error

    def status(self):
        return []


class _Assembly:
    model_name = "gemma-3-270m-q4_k_m"

    def __init__(self, error=None):
        self.error = error

    def progress(self):
        return {"model": self.model_name, "phase": "assembling", "percent": 40, "error": self.error}


@pytest.fixture
def parts(tmp_path):
    """(catalog over a folder holding one broken file, the 'chat' policy)."""
    engine, sessions = open_store(tmp_path / "data")
    catalog = Catalog.open(tmp_path / "data", sessions, SettingsCache(sessions), default_model=None)
    (catalog.models_dir / "broken.gguf").write_bytes(b"GGUF\x03\x00")
    catalog.rescan()
    yield catalog, ClassRegistry(sessions).get("chat")
    engine.dispose()


def _error(fn, *args) -> ApiError:
    with pytest.raises(ApiError) as exc:
        fn(*args)
    return exc.value


def test_unknown_and_unusable_models_are_404s(parts):
    catalog, chat = parts
    router = Router(catalog, _Residency())
    missing = _error(router.resolve, "nope", chat)
    assert (missing.status, missing.code, missing.param) == (404, "model_not_found", "model")
    assert missing.message == "unknown model 'nope'; available: none"
    unusable = _error(router.resolve, "broken", chat)
    assert (unusable.status, unusable.code) == (404, "model_unusable")


@pytest.mark.parametrize(("error", "code", "retry"), [(None, "default_model_assembling", "5"),
                                                      ("disk full", "default_model_failed", "60")])
def test_the_default_model_being_assembled_is_a_503_with_retry_after(parts, error, code, retry):
    catalog, chat = parts
    catalog.default_model_assembly = _Assembly(error)
    err = _error(Router(catalog, _Residency()).resolve, None, chat)
    assert (err.status, err.code, err.headers["Retry-After"]) == (503, code, retry)


@pytest.mark.parametrize(("raised", "status", "code"), [
    (UnknownModel("gone"), 404, "model_not_found"),
    (ModelLoadFailed("gone", "runner exited with 1"), 503, "model_load_failed"),
    (NotEnoughMemory("needs 2 GiB, 1 GiB free"), 503, "not_enough_memory"),
])
def test_residency_errors_become_http_errors(parts, raised, status, code):
    catalog, _ = parts
    err = _error(Router(catalog, _Residency(raised)).acquire, "gone")
    assert (err.status, err.code) == (status, code)
    assert status == 404 or "Retry-After" in err.headers
