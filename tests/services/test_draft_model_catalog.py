"""A model's draft model, chosen by the admin: the catalog checks it shares the model's vocabulary (the GGUF's
token list digest), passes it to the runner with -md while speculation is auto, and counts its memory in the
estimate; one that cannot draft (its own vocabulary, gone) leaves the runner without one and says why."""

from __future__ import annotations

from dataclasses import replace

import pytest
from sqlalchemy import select

from app.admin import AdminError, set_model_draft, set_model_speculation
from app.devtools.gguf_shapes import SHAPES, make_model
from app.gguf_meta import read_metadata
from app.residency.budget import KIND_RAM, counted_bytes
from app.residency.estimate import estimate_memory, with_draft
from app.services.catalog import Catalog
from app.services.settings import SettingsCache
from app.store import models as db
from app.store.db import open_store

TINY = SHAPES["tiny"]


@pytest.fixture
def catalog(tmp_path, standin_model):
    """A models folder with a target, a smaller model of its vocabulary, and one of another vocabulary."""
    models = tmp_path / "models"
    models.mkdir()
    make_model(replace(TINY, n_layer=4), models / "target.gguf")
    make_model(replace(TINY, n_layer=1), models / "small.gguf", seed=1)
    make_model(replace(TINY, n_layer=1, n_vocab=600), models / "stranger.gguf")
    engine, sessions = open_store(tmp_path / "data")
    yield Catalog.open(tmp_path / "data", sessions, SettingsCache(sessions), default_model=standin_model,
                       models_dir_override=str(models))
    engine.dispose()


def _set(catalog, name, draft, speculation=None):
    with catalog.sessions() as s:
        set_model_draft(s, name, draft)
        if speculation is not None:
            set_model_speculation(s, name, speculation)
        s.commit()
    catalog.rescan()
    return catalog.model_specs()[name]


def test_the_vocabulary_digest_tells_a_family_from_a_stranger(catalog):
    digests = {e.name: e.vocab_digest for e in catalog.entries}
    assert digests["target"] == digests["small"] != digests["stranger"]
    assert digests["target"] is not None and len(digests["target"]) == 64
    # Read from the file as stored: the same bytes give the same digest, reading it again changes nothing.
    assert read_metadata(next(e.path for e in catalog.entries if e.name == "target")).vocab_digest == digests["target"]


def test_a_draft_model_reaches_the_runner_with_md_and_its_memory_the_estimate(catalog):
    alone = catalog.model_specs()["target"]
    assert alone.runner.spec_type == "ngram-lookup" and alone.runner.draft_flag == []
    spec = _set(catalog, "target", "small")
    small = next(e for e in catalog.entries if e.name == "small")
    cmd = spec.runner.command(8081)
    assert cmd[cmd.index("--spec-type") + 1] == "draft-simple"
    assert cmd[cmd.index("-md") + 1] == str(small.path) and cmd.count("-md") == 1
    # The draft's weights, KV for the same cells and compute ride on the estimate; draft-simple reserves 3 rows,
    # not ngram-lookup's 64, so the rows shrink while the draft model's bytes are added.
    r = spec.runner
    assert r.n_outputs_extra == 3
    target = next(e for e in catalog.entries if e.name == "target")
    plain = estimate_memory(target, r.n_ctx, r.parallel, r.n_batch, n_outputs_extra=3, ram_tier_mib=r.ram_tier_mib)
    full = with_draft(plain, small, r.n_ctx, r.parallel, r.n_batch)
    assert full.draft_bytes == estimate_memory(small, r.n_ctx, r.parallel, r.n_batch).at_load_bytes > 0
    assert spec.estimate_bytes == counted_bytes(full, KIND_RAM) == counted_bytes(plain, KIND_RAM) + full.draft_bytes
    with catalog.sessions() as s:
        assert s.scalar(select(db.RunnerSettings.draft_model)) == "small"


def test_off_or_an_ngram_type_chosen_by_hand_keeps_the_draft_model_out(catalog):
    assert _set(catalog, "target", "small", "off").runner.draft_flag == []
    simple = _set(catalog, "target", "small", "ngram-simple").runner
    assert simple.spec_type == "ngram-simple" and simple.draft_flag == []
    back = _set(catalog, "target", "small", "auto").runner
    assert back.draft_flag[0] == "-md"
    cleared = _set(catalog, "target", "none").runner
    assert cleared.spec_type == "ngram-lookup" and cleared.draft_flag == []


def test_a_stock_llama_server_gets_its_own_flags(catalog):
    with catalog.sessions() as s:
        model_id = s.scalar(select(db.Model.id).where(db.Model.name == "target"))
        s.add(db.RunnerSettings(model_id=model_id, kind="llama-server", binary_path="/opt/llama-server"))
        s.commit()
    cmd = _set(catalog, "target", "small").runner.command(8081)
    assert cmd[0] == "/opt/llama-server"
    assert cmd[cmd.index("--spec-type") + 1] == "draft-simple" and cmd[cmd.index("-md") + 1].endswith("small.gguf")


def test_runner_args_naming_a_draft_model_win(catalog):
    from app.store.settings import set_setting

    with catalog.sessions() as s:
        set_setting(s, "runner_args", '{"target": ["-md", "/elsewhere/draft.gguf"]}')
        s.commit()
    cmd = _set(catalog, "target", "small").runner.command(8081)
    assert cmd.count("-md") == 1 and cmd[cmd.index("-md") + 1] == "/elsewhere/draft.gguf"


def test_a_draft_that_cannot_draft_leaves_none_and_says_why(catalog):
    spec = _set(catalog, "target", "stranger")
    assert spec.runner.draft_flag == [] and spec.runner.spec_type == "ngram-lookup"
    assert "draft model stranger: its vocabulary is not target's" in spec.sizing_note
    (catalog.models_dir / "small.gguf").unlink()
    spec = _set(catalog, "target", "small")
    assert spec.runner.draft_flag == [] and "draft model small is not in the models folder" in spec.sizing_note


def test_the_admin_refuses_a_draft_that_is_the_model_or_unknown(catalog):
    with catalog.sessions() as s:
        with pytest.raises(AdminError, match="cannot be its own draft model"):
            set_model_draft(s, "target", "target")
        with pytest.raises(AdminError, match="no model 'nope' to draft with"):
            set_model_draft(s, "target", "nope")
        with pytest.raises(AdminError, match="no model 'nope'"):
            set_model_draft(s, "nope", "small")


def test_the_runner_command_parses_into_a_draft_model_config(catalog):
    """What serve starts is what `hearth runner` understands: the -md file loads with the target's threads."""
    from app.cli import build_parser
    from app.runner.command import draft_model_config, spec_config

    runner = _set(catalog, "target", "small").runner
    cmd = runner.command(8081)
    args = build_parser().parse_args(cmd[cmd.index("runner"):])
    spec = spec_config(args)
    assert spec.type == "draft-simple" and spec.uses_draft_model and spec.draft_by_cost
    draft = draft_model_config(args, spec)
    assert draft.path == runner.draft_model_path and draft.n_threads == runner.threads
