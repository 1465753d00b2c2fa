"""The Models page: catalog with estimates and unusable files, load/unload/policy controls, polling card, events."""

from datetime import UTC, datetime

import pytest

from app.gateway.context import services
from app.residency.manager import ModelLoadFailed, ModelState
from app.store.models import Model, ResidencyEvent
from tests.helpers import wait_until


@pytest.fixture
def app(app, tmp_path):
    """The dashboard with a broken GGUF beside the embedded model (rescanned so the catalog sees it)."""
    (tmp_path / "models" / "broken.gguf").write_bytes(b"GGUF\x03\x00")
    services(app).catalog.rescan()
    return app


def _gemma(app):
    return next(e.name for e in services(app).catalog.entries if e.usable)


def _post(admin, csrf_token, url, **data):
    return admin.post(url, data={**data, "csrf_token": csrf_token(admin, "/models")}, headers={"HX-Request": "true"})


def test_catalog_with_estimates_and_unusable_reason(app, admin):
    r = admin.get("/models")
    assert r.status_code == 200
    html = r.get_data(as_text=True)
    gemma = _gemma(app)
    assert gemma in html and "Weights" in html and "KV cache (" in html and "Compute buffers" in html
    assert "not loaded yet" in html and "never loaded" in html
    # No runner settings stored: slots and cells are sized, and the card says why.
    assert "sized from the memory budget and the model" in html and "KV cells: 1,024 per slot" in html
    assert "broken" in html and "cannot be served" in html and "Replace the file" in html
    assert "No loads, unloads or evictions yet" in html


def test_measured_footprint_cold_starts_and_events_from_history(app, admin):
    gemma = _gemma(app)
    with services(app).sessions() as s:
        for ms in (1000.0, 2000.0, 3000.0):
            s.add(ResidencyEvent(at=datetime.now(UTC), model_name=gemma, event="load", reason="first request",
                                 cold_start_ms=ms, estimate_bytes=400 * 2**20, measured_bytes=420 * 2**20))
        s.add(ResidencyEvent(at=datetime.now(UTC), model_name=gemma, event="evict", reason="evicted to make room for x"))
        s.commit()
    html = admin.get("/models").get_data(as_text=True)
    assert "median 2 s over 3 loads" in html and "420.0 MiB" in html
    assert "evicted to make room" in html and 'data-state="unloaded"' in html
    events = admin.get("/models/events").get_data(as_text=True)
    assert events.startswith('<div id="residency-events">') and events.count("<tr>") == 5


def test_load_failure_is_shown_on_the_card(app, admin, csrf_token, monkeypatch):
    gemma = _gemma(app)

    def fail(name):
        raise ModelLoadFailed(name, "runner exited with code 1 while loading")

    monkeypatch.setattr(services(app).residency, "load", fail)
    _post(admin, csrf_token, f"/models/{gemma}/load")
    card = admin.get(f"/models/{gemma}/card")
    assert card.status_code == 286  # not loading: htmx stops polling
    assert "Load failed" in card.get_data(as_text=True) and "exited with code 1" in card.get_data(as_text=True)


def test_unusable_and_unknown_models_are_refused(admin, csrf_token):
    r = _post(admin, csrf_token, "/models/broken/load")
    assert r.status_code == 409 and "broken cannot be served" in r.get_data(as_text=True)
    assert _post(admin, csrf_token, "/models/nope/load").status_code == 404
    assert admin.get("/models/nope/card").status_code == 404


def test_policy_and_keep_alive_validation(app, admin, csrf_token):
    gemma = _gemma(app)
    r = _post(admin, csrf_token, f"/models/{gemma}/policy", policy="keep_alive", keep_alive_s="ten minutes")
    assert r.status_code == 422
    html = r.get_data(as_text=True)
    assert "is not a whole number of seconds" in html and 'value="ten minutes"' in html
    r = _post(admin, csrf_token, f"/models/{gemma}/policy", policy="forever", keep_alive_s="60")
    assert r.status_code == 422 and "Choose one of" in r.get_data(as_text=True)
    assert _post(admin, csrf_token, f"/models/{gemma}/policy", policy="keep_alive", keep_alive_s="0").status_code == 422
    r = _post(admin, csrf_token, f"/models/{gemma}/policy", policy="on_demand", keep_alive_s="900")
    assert r.status_code == 200 and "Saved: on demand" in r.get_data(as_text=True)
    hearth = services(app)
    with hearth.sessions() as s:
        row = s.query(Model).filter_by(name=gemma).one()
        assert (row.policy, row.keep_alive_s) == ("on_demand", 900)
    assert hearth.catalog.model_specs()[gemma].policy == "on_demand"  # applied at once, not at the next rescan


def test_controls_need_csrf(app, admin):
    gemma = _gemma(app)
    assert admin.post(f"/models/{gemma}/load").status_code == 400
    assert admin.post(f"/models/{gemma}/policy", data={"policy": "pinned", "keep_alive_s": "5"}).status_code == 400


class TestWithTheEmbeddedModel:
    """The real GGUF is the embedded model here (so these are `model` tests): a load starts a real runner."""

    @pytest.fixture
    def default_model_path(self, gemma_path):
        """The embedded Gemma GGUF instead of the stand-in."""
        return gemma_path

    def test_load_polls_until_resident_then_unload(self, app, admin, csrf_token):
        gemma = _gemma(app)
        r = _post(admin, csrf_token, f"/models/{gemma}/load")
        assert r.status_code == 200
        html = r.get_data(as_text=True)
        assert 'data-state="loading"' in html and 'hx-trigger="every 1s"' in html and "Loading for" in html

        def resident_card():
            card = admin.get(f"/models/{gemma}/card")
            assert card.status_code in (200, 286)
            return card if card.status_code == 286 else None

        card = wait_until(resident_card, 120, "the card never said resident (HTTP 286)", every_s=0.3)
        html = card.get_data(as_text=True)
        assert f'data-state="{ModelState.READY}"' in html and "hx-trigger" not in html and "Unload" in html
        # The page's tiles come along out of band, so "Resident" no longer says 0.
        tiles = html[html.index('id="model-tiles" hx-swap-oob="true"'):]
        assert '<div class="tile-label">Resident</div>\n  <div class="tile-value">1' in tiles
        assert "Runner log" in html and "Measured after the last load" in html
        r = _post(admin, csrf_token, f"/models/{gemma}/unload")
        assert r.status_code == 200 and "Unloaded" in r.get_data(as_text=True)
        assert 'data-state="unloaded"' in r.get_data(as_text=True)
        assert [e["state"] for e in services(app).residency.status() if e["name"] == gemma] == [ModelState.UNLOADED]


def test_pinning_loads_the_model(app, admin, csrf_token, monkeypatch):
    gemma = _gemma(app)
    loads = []
    monkeypatch.setattr(services(app).residency, "load", loads.append)
    r = _post(admin, csrf_token, f"/models/{gemma}/policy", policy="pinned", keep_alive_s="300")
    assert r.status_code == 200 and "Pinned" in r.get_data(as_text=True) and "Loading it now" in r.get_data(as_text=True)
    wait_until(lambda: loads, 5, "pinning never asked residency to load the model")
    assert loads == [gemma]


def test_without_javascript_the_whole_page_comes_back(app, admin, csrf_token):
    gemma = _gemma(app)
    r = admin.post(f"/models/{gemma}/policy", data={"policy": "keep_alive", "keep_alive_s": "soon",
                                                    "csrf_token": csrf_token(admin, "/models")})
    assert r.status_code == 422
    html = r.get_data(as_text=True)
    assert "<html" in html and "Recent residency events" in html
    assert "is not a whole number of seconds" in html and 'value="soon"' in html
    r = admin.post(f"/models/{gemma}/unload", data={"csrf_token": csrf_token(admin, "/models")})
    assert r.status_code == 200 and "<html" in r.get_data(as_text=True) and "It was not loaded." in r.get_data(as_text=True)
