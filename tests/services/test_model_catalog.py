"""The catalog service: which folder, which names, and domain errors for what cannot be served."""

from pathlib import Path

import pytest
from sqlalchemy import select

from app.services.catalog import (
    Catalog,
    DefaultModelPending,
    ModelNotFound,
    ModelUnusable,
    resolve_models_dir,
)
from app.services.settings import SettingsCache
from app.store import models as db
from app.store.db import open_store
from app.store.settings import set_setting


@pytest.fixture
def store(tmp_path):
    """(data folder, sessions) of a migrated, seeded store."""
    data = tmp_path / "data"
    engine, sessions = open_store(data)
    yield data, sessions
    engine.dispose()


def _set(sessions, name, value):
    with sessions() as s:
        set_setting(s, name, value)
        s.commit()


def test_the_override_wins_over_the_stored_folder_which_wins_over_data_models(tmp_path):
    data = tmp_path / "data"
    assert resolve_models_dir(data, None, None) == data / "models"
    assert resolve_models_dir(data, "/srv/models", None) == Path("/srv/models")
    assert resolve_models_dir(data, "/srv/models", "/env/models") == Path("/env/models")


def test_open_scans_the_stored_folder_and_records_what_it_found(store, tmp_path):
    data, sessions = store
    stored = tmp_path / "stored-models"
    stored.mkdir()
    _set(sessions, "models_dir", str(stored))
    (stored / "broken.gguf").write_bytes(b"GGUF\x03\x00")
    catalog = Catalog.open(data, sessions, SettingsCache(sessions), default_model=None)
    assert catalog.models_dir == stored
    assert [(e.name, e.usable) for e in catalog.entries] == [("broken", False)]
    with sessions() as s:
        assert s.scalars(select(db.Model.name)).all() == ["broken"]
    assert catalog.model_specs() == {}


def test_names_that_cannot_be_served_raise_domain_errors(store):
    data, sessions = store
    catalog = Catalog.open(data, sessions, SettingsCache(sessions), default_model=None)
    (catalog.models_dir / "broken.gguf").write_bytes(b"GGUF\x03\x00")
    catalog.rescan()
    with pytest.raises(ModelUnusable) as unusable:
        catalog.resolve("broken")
    assert unusable.value.reason and "cannot be served" in str(unusable.value)
    with pytest.raises(ModelNotFound) as missing:
        catalog.resolve("nope")
    assert missing.value.known == [] and str(missing.value) == "unknown model 'nope'; available: none"


class _Assembling:
    model_name = "gemma-3-270m-q4_k_m"

    def progress(self):
        return {"model": self.model_name, "phase": "assembling", "percent": 40, "error": None}


def test_the_default_model_is_pending_while_it_is_assembled(store):
    data, sessions = store
    catalog = Catalog.open(data, sessions, SettingsCache(sessions), default_model=None)
    catalog.default_model_assembly = _Assembling()
    assert catalog.default_model_name() == "gemma-3-270m-q4_k_m"
    with pytest.raises(DefaultModelPending) as pending:
        catalog.resolve(None)
    assert pending.value.progress["percent"] == 40


def test_specs_carry_each_models_runner_settings_and_aliases(store, gemma_path):
    data, sessions = store
    _set(sessions, "runner_parallel", 2)
    catalog = Catalog.open(data, sessions, SettingsCache(sessions), default_model=gemma_path)
    name = catalog.entries[0].name
    with sessions() as s:
        row = s.scalar(select(db.Model).where(db.Model.name == name))
        row.alias = "assistant"
        s.add(db.RunnerSettings(model_id=row.id, kind="hearth", n_ctx=1024))
        s.commit()
    before = catalog.model_specs()[name].estimate_bytes
    catalog.rescan()
    spec = catalog.model_specs()[name]
    assert (spec.runner.n_ctx, spec.runner.parallel) == (1024, 2)  # its own ctx, the stored default parallel
    assert spec.estimate_bytes < before  # fewer KV cells
    assert catalog.resolve("assistant") == name and catalog.resolve(None) == name
