"""Warm weights and cold starts on the Models page: the weights choice (saved, refused), the page-cache share,
and each load's stacked bar with the tier of every part (a stock llama-server's load shown as not split)."""

from __future__ import annotations

import html as htmllib
import re
from datetime import UTC, datetime, timedelta

from sqlalchemy import select

from app.gateway.context import services
from app.residency.pagecache import cached_fraction, drop, read_ahead
from app.store.models import Model, ResidencyEvent, RunnerSettings


def _model(app) -> str:
    return next(iter(services(app).catalog.model_specs()))


def _post(admin, csrf_token, url, page, **data):
    return admin.post(url, data={**data, "csrf_token": csrf_token(admin, page)}, headers={"HX-Request": "true"})


def _stored(app, name):
    with services(app).sessions() as s:
        model_id = s.scalar(select(Model.id).where(Model.name == name))
        return s.scalar(select(RunnerSettings.weights).where(RunnerSettings.model_id == model_id))


def _page(admin) -> str:
    return htmllib.unescape(admin.get("/models").get_data(as_text=True))


def test_the_card_offers_the_weights_choice_and_says_what_pinned_means(app, admin):
    page = _page(admin)
    assert '<select name="weights"' in page
    assert '<option value="warm" selected>Warm: kept in the page cache after its runner stops' in page
    assert '<option value="pinned">Pinned: kept in the page cache always' in page
    assert "Pinned is not locked in memory (no mlock)" in page


def test_the_card_shows_the_files_share_in_the_page_cache_as_mincore_measures_it(app, admin):
    path = services(app).catalog.model_specs()[_model(app)].path
    read_ahead(path)
    assert "in page cache: 100 %" in _page(admin)
    drop(path)
    shown = re.search(r"in page cache: (\d+) %", _page(admin))
    assert shown and int(shown.group(1)) == round(100 * cached_fraction(path))


def test_saving_the_choice_round_trips_to_the_store_and_the_spec(app, admin, csrf_token):
    name = _model(app)
    r = _post(admin, csrf_token, f"/models/{name}/weights", "/models", weights="cold")
    assert r.status_code == 200, r.get_data(as_text=True)
    body = htmllib.unescape(r.get_data(as_text=True))
    assert "Saved: weights cold." in body and '<option value="cold" selected>' in body
    assert _stored(app, name) == "cold" and services(app).catalog.model_specs()[name].weights == "cold"
    assert _post(admin, csrf_token, f"/models/{name}/weights", "/models", weights="pinned").status_code == 200
    assert services(app).catalog.model_specs()[name].weights == "pinned"
    # Warm is the default: stored as NULL.
    assert _post(admin, csrf_token, f"/models/{name}/weights", "/models", weights="warm").status_code == 200
    assert _stored(app, name) is None and services(app).catalog.model_specs()[name].weights == "warm"


def test_a_bad_choice_is_refused_with_what_to_choose(app, admin, csrf_token):
    name = _model(app)
    for value in ("hot", ""):
        r = _post(admin, csrf_token, f"/models/{name}/weights", "/models", weights=value)
        assert r.status_code == 422
        assert "Weights: choose one of: pinned, warm, cold" in htmllib.unescape(r.get_data(as_text=True))
    assert _stored(app, name) is None


def _load(app, name, at, **fields):
    with services(app).sessions() as s:
        s.add(ResidencyEvent(at=at, model_name=name, event="load", reason="first request", **fields))
        s.commit()


def test_each_load_is_a_stacked_bar_with_the_tier_of_each_part(app, admin):
    name = _model(app)
    now = datetime.now(UTC).replace(microsecond=0)
    # Hearth runner, weights from disk, KV restored from the disk tier, first prefill measured.
    _load(app, name, now - timedelta(minutes=2), cold_start_ms=4000.0, load_read_ms=2500.0, load_context_ms=300.0,
          first_prefill_ms=600.0, load_restore_ms=150.0, weights_source="disk", kv_source="disk")
    # A stock llama-server: only start to ready, and where its weights were.
    _load(app, name, now - timedelta(minutes=1), cold_start_ms=2000.0, weights_source="page_cache")
    page = _page(admin)
    bars = re.findall(r'<li class="load-split" data-total-ms="([\d.]+)">(.*?)</li>', page, re.S)
    assert len(bars) == 2
    (stock_total, stock), (split_total, split) = bars  # newest first
    assert float(stock_total) == 2000.0 and "start to ready (not split) 2 s <em>(weights in page cache)</em>" in stock
    assert "a stock llama-server tells only its start to ready" in stock
    # 4000 ms load = 1200 process start + 2500 read + 300 context, then 150 restore and 600 prefill.
    assert float(split_total) == 4750.0
    assert 'aria-label="process start 1200 ms, weights read 2500 ms from disk, context built 300 ms, ' \
           'KV restored 150 ms from disk, first prefill 600 ms"' in split
    assert "GPU upload" not in split  # no GPU layers: the part is absent
    # Widths to the longest load's scale: the 2500 ms read of a 4750 ms bar.
    assert 'class="load-part-read tier-disk" style="width: 52.63%"' in split
    assert 'class="load-part-whole tier-weights-in-page-cache" style="width: 42.11%"' in stock


def test_a_load_whose_weights_came_from_the_page_cache_and_its_gpu_upload_are_named(app, admin):
    name = _model(app)
    _load(app, name, datetime.now(UTC), cold_start_ms=900.0, load_read_ms=80.0, load_upload_ms=400.0,
          load_context_ms=100.0, weights_source="page_cache", kv_source="none")
    page = _page(admin)
    assert "weights read 80 ms <em>(page cache)</em>" in page
    assert "GPU upload 400 ms <em>(GPU)</em>" in page
    assert "first prefill: no request yet" in page and "KV restored" not in page
