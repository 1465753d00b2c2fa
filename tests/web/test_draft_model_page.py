"""The Models page's draft model: each card offers the smaller models of its vocabulary, a choice is stored and
reaches the runner's command (-md), and one that cannot draft is refused on the card with the reason."""

from __future__ import annotations

import html as htmllib
from dataclasses import replace

import pytest
from sqlalchemy import select

from app.devtools.gguf_shapes import SHAPES, make_model
from app.gateway.context import services
from app.store.models import Model, RunnerSettings
from tests.web.test_speculation_pages import _post

TINY = SHAPES["tiny"]


@pytest.fixture
def family(app, tmp_path):
    """target and small share a vocabulary; stranger has its own."""
    models = services(app).catalog.models_dir
    models.mkdir(parents=True, exist_ok=True)
    make_model(replace(TINY, n_layer=4), models / "target.gguf")
    make_model(replace(TINY, n_layer=1), models / "small.gguf", seed=1)
    make_model(replace(TINY, n_layer=1, n_vocab=600), models / "stranger.gguf")
    services(app).catalog.rescan()
    return models


def _card(page: str, name: str) -> str:
    start = page.index(f'action="/models/{name}/draft"')
    return page[start:page.index("</form>", start)]


def test_each_card_offers_the_smaller_models_of_its_vocabulary(app, admin, family):
    page = htmllib.unescape(admin.get("/models").get_data(as_text=True))
    target = _card(page, "target")
    assert "Draft model" in page and '<option value="small">small</option>' in target
    assert "stranger" not in target and '<option value="target">' not in target
    assert "None: drafts come from the context (n-grams)" in target
    # The smallest model has nothing smaller of its vocabulary to offer.
    assert "No model in the folder has this one's vocabulary and a smaller file." in _card(page, "small")


def test_a_choice_is_stored_and_reaches_the_runner(app, admin, csrf_token, family):
    r = _post(admin, csrf_token, "/models/target/draft", "/models", draft_model="small")
    assert r.status_code == 200, r.get_data(as_text=True)
    body = htmllib.unescape(r.get_data(as_text=True))
    assert "Saved: small drafts for target while its speculative decoding is auto." in body
    assert f"<code>-md {family / 'small.gguf'}</code>" in body and "<code>--spec-type draft-simple</code>" in body
    assert '<option value="small" selected>small</option>' in body
    with services(app).sessions() as s:
        model_id = s.scalar(select(Model.id).where(Model.name == "target"))
        assert s.scalar(select(RunnerSettings.draft_model).where(RunnerSettings.model_id == model_id)) == "small"
    cmd = services(app).catalog.model_specs()["target"].runner.command(8081)
    assert cmd[cmd.index("-md") + 1] == str(family / "small.gguf")
    r = _post(admin, csrf_token, "/models/target/draft", "/models", draft_model="")
    assert "Saved: no draft model." in r.get_data(as_text=True)
    assert services(app).catalog.model_specs()["target"].runner.draft_flag == []


@pytest.mark.parametrize(("value", "reason"), [
    ("stranger", "stranger cannot draft for target: its vocabulary is not target's"),
    ("target", "cannot draft for target: a model cannot be its own draft model"),
    ("nope", "No model 'nope' in the models folder."),
])
def test_a_draft_that_cannot_draft_is_refused_on_the_card(app, admin, csrf_token, family, value, reason):
    r = _post(admin, csrf_token, "/models/target/draft", "/models", draft_model=value)
    assert r.status_code == 422
    body = htmllib.unescape(r.get_data(as_text=True))
    assert reason in body and 'class="field-error"' in body
    assert services(app).catalog.model_specs()["target"].runner.draft_flag == []


def test_saving_a_draft_model_needs_csrf(app, admin, family):
    r = admin.post("/models/target/draft", data={"draft_model": "small"}, headers={"HX-Request": "true"})
    assert r.status_code in (400, 403)
