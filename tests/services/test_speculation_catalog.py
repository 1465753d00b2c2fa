"""The catalog service with speculative decoding: each model's stored setting becomes its runner's --spec-type
at the next rescan, and the estimate it is admitted by counts the draft rows that reserves."""

from __future__ import annotations

import pytest
from sqlalchemy import select

from app.admin import AdminError, set_model_speculation
from app.engine.speculation import LOOKUP_DRAFT_MAX
from app.services.catalog import Catalog
from app.services.settings import SettingsCache
from app.store import models as db
from app.store.db import open_store


@pytest.fixture
def catalog(tmp_path, standin_model):
    """A catalog on a fresh store whose only model is the stand-in (the embedded default)."""
    engine, sessions = open_store(tmp_path / "data")
    yield Catalog.open(tmp_path / "data", sessions, SettingsCache(sessions), default_model=standin_model,
                       models_dir_override=str(tmp_path / "models"))
    engine.dispose()


def _set(catalog, name, value):
    with catalog.sessions() as s:
        set_model_speculation(s, name, value)
        s.commit()
    catalog.rescan()
    return catalog.model_specs()[name]


def test_the_setting_reaches_the_spec_and_the_estimate_at_the_next_rescan(catalog):
    (name,) = catalog.model_specs()
    auto = catalog.model_specs()[name]
    assert auto.runner.spec_type == "ngram-lookup" and auto.runner.n_outputs_extra == LOOKUP_DRAFT_MAX
    off = _set(catalog, name, "off")
    assert off.runner.spec_type == "none" and off.runner.n_outputs_extra == 0
    assert off.estimate_bytes < auto.estimate_bytes
    assert "--spec-type" in (cmd := off.runner.command(8081)) and cmd[cmd.index("--spec-type") + 1] == "none"
    simple = _set(catalog, name, "NGRAM-SIMPLE ")
    # ngram-simple drafts up to its 48-token continuation: fewer rows than ngram-lookup's own length.
    assert simple.runner.spec_type == "ngram-simple" and simple.runner.n_outputs_extra == 48
    assert off.estimate_bytes < simple.estimate_bytes
    assert (simple.estimate_bytes < auto.estimate_bytes) == (48 < LOOKUP_DRAFT_MAX)
    assert _set(catalog, name, "auto").runner.spec_type == "ngram-lookup"
    with catalog.sessions() as s:
        assert s.scalar(select(db.RunnerSettings.speculation)) is None


def test_a_setting_the_runner_kind_cannot_take_is_refused(catalog):
    (name,) = catalog.model_specs()
    with catalog.sessions() as s:
        with pytest.raises(AdminError, match="no model 'nope'"):
            set_model_speculation(s, "nope", "off")
        with pytest.raises(AdminError, match="'eagle3': choose one of: auto, off"):
            set_model_speculation(s, name, "eagle3")
        model_id = s.scalar(select(db.Model.id).where(db.Model.name == name))
        s.add(db.RunnerSettings(model_id=model_id, kind="llama-server", binary_path="/opt/llama-server"))
        s.flush()
        with pytest.raises(AdminError, match="ngram-lookup is Hearth's own"):
            set_model_speculation(s, name, "ngram-lookup")
        set_model_speculation(s, name, "ngram-simple")
        s.commit()
    catalog.rescan()
    runner = catalog.model_specs()[name].runner
    assert runner.spec_type == "ngram-simple" and runner.n_outputs_extra == 0
    assert runner.command(8081)[-2:] == ["--spec-type", "ngram-simple"]
