"""The Models page's KV cache choice: each card offers f16, q8_0 and q4_0 (K and V alike), a choice is stored
(migration 0020), reaches the runner's command (-ctk/-ctv) and the card's estimate (its KV row shrinks), and an
unknown type is refused on the card with what to choose."""

from __future__ import annotations

import html as htmllib
from dataclasses import replace

import pytest
from sqlalchemy import select

from app.admin import AdminError, set_model_kv_types
from app.devtools.gguf_shapes import SHAPES, make_model
from app.gateway.context import services
from app.residency.estimate import estimate_memory
from app.store.models import Model, RunnerSettings
from tests.web.test_speculation_pages import _post

TINY = SHAPES["tiny"]


@pytest.fixture
def model(app):
    models = services(app).catalog.models_dir
    models.mkdir(parents=True, exist_ok=True)
    make_model(replace(TINY, n_layer=4), models / "target.gguf")
    services(app).catalog.rescan()
    return models / "target.gguf"


def _form(page: str, name: str) -> str:
    start = page.index(f'action="/models/{name}/kv-cache"')
    return page[start:page.index("</form>", start)]


def _stored(app, name):
    with services(app).sessions() as s:
        model_id = s.scalar(select(Model.id).where(Model.name == name))
        return s.execute(select(RunnerSettings.cache_type_k, RunnerSettings.cache_type_v)
                         .where(RunnerSettings.model_id == model_id)).one_or_none()


def test_each_card_offers_the_kv_types_with_f16_chosen(app, admin, model):
    page = htmllib.unescape(admin.get("/models").get_data(as_text=True))
    form = _form(page, "target")
    assert "KV cache" in form and '<option value="f16" selected>' in form
    assert '<option value="q8_0">q8_0: 53 % of f16' in form and '<option value="q4_0">' in form
    # The default passes no flag: a model left alone starts as before.
    assert "Runner: <code>-ctk" not in form
    assert services(app).catalog.model_specs()["target"].runner.kv_type_flag == []


def test_a_choice_is_stored_and_reaches_the_runner_and_the_estimate(app, admin, csrf_token, model):
    entry = next(e for e in services(app).catalog.entries if e.name == "target")
    before = services(app).catalog.model_specs()["target"]
    r = _post(admin, csrf_token, "/models/target/kv-cache", "/models", kv_cache="q8_0")
    assert r.status_code == 200, r.get_data(as_text=True)
    body = htmllib.unescape(r.get_data(as_text=True))
    assert "Saved: KV cache q8_0." in body and "<code>-ctk q8_0 -ctv q8_0</code>" in body
    assert '<option value="q8_0" selected>' in body and "K q8_0, V q8_0)" in body
    assert _stored(app, "target") == ("q8_0", "q8_0")
    spec = services(app).catalog.model_specs()["target"]
    cmd = spec.runner.command(8081)
    assert cmd[cmd.index("-ctk") + 1] == "q8_0" and cmd[cmd.index("-ctv") + 1] == "q8_0"
    # The catalog's estimate counts the smaller cache: what the KV row loses and nothing else.
    r_ = spec.runner
    f16_kv = estimate_memory(entry, r_.n_ctx, r_.parallel, r_.n_batch).kv_bytes
    assert before.estimate_bytes - spec.estimate_bytes == f16_kv - f16_kv * 17 // 32 > 0
    # Back to f16: stored as NULL (llama.cpp's default), no flag.
    r = _post(admin, csrf_token, "/models/target/kv-cache", "/models", kv_cache="f16")
    assert "Saved: KV cache f16." in r.get_data(as_text=True)
    assert _stored(app, "target") == (None, None)
    assert services(app).catalog.model_specs()["target"].runner.kv_type_flag == []


def test_an_unknown_type_is_refused_on_the_card(app, admin, csrf_token, model):
    r = _post(admin, csrf_token, "/models/target/kv-cache", "/models", kv_cache="q9")
    assert r.status_code == 422
    body = htmllib.unescape(r.get_data(as_text=True))
    assert "Choose one of: f16, q8_0, q4_0." in body and 'class="field-error"' in body
    assert _stored(app, "target") is None


def test_the_admin_function_checks_the_model_and_the_types(app, model):
    with services(app).sessions() as s:
        with pytest.raises(AdminError, match="no model 'nope'"):
            set_model_kv_types(s, "nope", "q8_0")
        with pytest.raises(AdminError, match="choose one of"):
            set_model_kv_types(s, "target", "q9")
        rs = set_model_kv_types(s, "target", "q8_0", "f16")
        assert (rs.cache_type_k, rs.cache_type_v) == ("q8_0", None)


def test_saving_a_kv_type_needs_csrf(app, admin, model):
    r = admin.post("/models/target/kv-cache", data={"kv_cache": "q8_0"}, headers={"HX-Request": "true"})
    assert r.status_code in (400, 403)


def test_the_placement_settings_reach_the_runner_and_bad_ones_are_refused(app, model):
    from app.admin import set_model_placement

    with services(app).sessions() as s:
        for kwargs, message in (({"n_cpu_moe": -2}, "--n-cpu-moe"), ({"tensor_split": "3,x"}, "--tensor-split"),
                                ({"split_mode": "diagonal"}, "--split-mode"), ({"main_gpu": -1}, "--main-gpu"),
                                # Issue 50: non-finite and absurd numbers, saved or an OverflowError before.
                                ({"tensor_split": "nan"}, "--tensor-split"), ({"tensor_split": "inf"}, "--tensor-split"),
                                ({"tensor_split": "1e308,1"}, "--tensor-split"),
                                ({"main_gpu": 99999999999999999999}, "--main-gpu"), ({"main_gpu": 16}, "--main-gpu")):
            with pytest.raises(AdminError, match=message):
                set_model_placement(s, "target", **kwargs)
        set_model_placement(s, "target", n_cpu_moe=-1, devices="Vulkan0, Vulkan1", tensor_split="3,1",
                            split_mode="row", main_gpu=1)
        s.commit()
    services(app).catalog.rescan()
    runner = services(app).catalog.model_specs()["target"].runner
    assert runner.placement_flag == ["--cpu-moe", "--device", "Vulkan0,Vulkan1", "--tensor-split", "3,1",
                                     "--split-mode", "row", "--main-gpu", "1"]
    with services(app).sessions() as s:
        set_model_placement(s, "target", n_cpu_moe=0, devices="", tensor_split="", split_mode="layer", main_gpu=0)
        s.commit()
    services(app).catalog.rescan()
    assert services(app).catalog.model_specs()["target"].runner.placement_flag == []
