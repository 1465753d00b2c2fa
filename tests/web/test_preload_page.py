"""The Preload page: heat strips from the request log, the recommended schedule with its evidence, Apply, Remove."""

from __future__ import annotations

import re
from datetime import UTC, date, datetime, timedelta, timezone

import pytest

from app.gateway.context import services
from app.services.preload import Outcome, schedule
from app.store.models import PreloadEntry, RequestRecord, ResidencyEvent

TZ = timezone(timedelta(hours=2))
NOW = datetime(2026, 11, 30, 12, 0, tzinfo=TZ)  # a Monday; the 14 days before hold 10 weekdays and 4 weekend days
DAYS = [date(2026, 11, d) for d in range(17, 31)]


def _gemma(app):
    return next(e.name for e in services(app).catalog.entries if e.usable)


def _seed(app, days):
    """The embedded model wanted at 06:35 on `days`, cold starts of 1–3 s measured, and something logged every day."""
    svc = services(app)
    svc.preload.clock, svc.preload.tz = (lambda: NOW), TZ
    name = _gemma(app)
    with svc.sessions() as s:
        s.add_all(RequestRecord(arrival_at=datetime(d.year, d.month, d.day, 6, 35, tzinfo=TZ).astimezone(UTC), model=name,
                                class_name="voice", status="ok") for d in days)
        # Something every evening (a request refused before it named a model): every day of the 14 has data.
        s.add_all(RequestRecord(arrival_at=datetime(d.year, d.month, d.day, 21, 0, tzinfo=TZ).astimezone(UTC),
                                status="rejected") for d in DAYS)
        s.add_all(ResidencyEvent(at=datetime(2026, 11, 1, tzinfo=UTC), model_name=name, event="load", reason="first request",
                                 cold_start_ms=ms) for ms in (1000.0, 2000.0, 3000.0))
        s.commit()
    return name


@pytest.fixture
def wanted(app):
    """Every weekday morning but one, and no weekend morning."""
    return _seed(app, [d for d in DAYS if d.weekday() < 5 and d != date(2026, 11, 25)])


def test_panel_shows_the_heat_strip_and_the_recommended_schedule(app, admin, wanted):
    r = admin.get("/preload")
    assert r.status_code == 200
    html = r.get_data(as_text=True)
    assert '<a href="/preload" class="active" aria-current="page">Preload</a>' in html
    row = re.search(rf'<div class="heat-row" role="listitem" data-model="{re.escape(wanted)}" data-days="weekdays">(.*?)</div>\s*</div>',
                    html, re.S).group(1)
    cells = re.findall(r'<span class="heat-cell( in-window)?( preload-at)?" style="--share: (\d+)%" data-share="([\d.]+)"'
                       r'\s+title="([^"]+)"', row)
    assert len(cells) == 96
    # 06:30 is slot 26: 9 of the 10 weekdays, and the one slot of the recommended window; its load is at 06:15.
    assert cells[26] == (" in-window", "", "90", "0.90", "06:30–06:45: wanted on 9 of 10 weekdays, 9 requests")
    assert cells[25] == ("", " preload-at", "0", "0.00",
                         "06:15–06:30: wanted on 0 of 10 weekdays, 0 requests; recommended load at 06:15")
    assert [i for i, c in enumerate(cells) if c[0]] == [26] and [i for i, c in enumerate(cells) if c[1]] == [25]
    assert {c[3] for i, c in enumerate(cells) if i != 26} == {"0.00"}
    assert "UTC+02:00" in html and "weekdays and weekends apart: 10 weekdays and 4 weekend days of data" in html
    assert (f'<tr data-key="{wanted}|weekdays|06:15">' in html and "wanted on 9 of 10 weekdays between 06:30 and 06:45 "
            "(9 requests); cold start 2.0 s (median of 3 loads) → load at 06:15") in html
    assert "Apply: 1 load</button>" in html and "No schedule applied" in html


def test_apply_stores_the_schedule_and_remove_takes_an_entry_out(app, admin, wanted, csrf_token):
    token = csrf_token(admin, "/preload")
    r = admin.post("/preload/apply", data={"csrf_token": token, "days": "14", "entry": f"{wanted}|weekdays|06:15"})
    assert r.status_code == 302 and r.headers["Location"] == "/preload?days=14"
    with services(app).sessions() as s:
        [e] = schedule(s)
        assert (e.model_name, e.days, e.at_minute, e.window_start_minute, e.window_end_minute, e.applied_by) == (
            wanted, "weekdays", 375, 390, 405, "admin")
    # What the job did is shown beside the schedule.
    services(app).preload.outcomes.appendleft(Outcome(NOW.astimezone(UTC), wanted, "06:15", "refused", "not enough memory for it"))
    html = admin.get("/preload").get_data(as_text=True)
    assert f"Preload schedule applied: {wanted} at 06:15 on weekdays" in html
    assert (f"2026-11-30 10:00 UTC · {wanted} (06:15): <span class=\"badge badge-bad\">refused</span> "
            "not enough memory for it") in html
    assert f'<tr data-entry="{e.id}">' in html and "Apply: 1 load, replacing the 1 applied</button>" in html
    r = admin.post(f"/preload/{e.id}/remove", data={"csrf_token": token, "days": "14"})
    assert r.status_code == 302
    with services(app).sessions() as s:
        assert schedule(s) == []
    assert "Removed: " in admin.get("/preload").get_data(as_text=True)
    r = admin.post(f"/preload/{e.id}/remove", data={"csrf_token": token})
    assert r.status_code == 404 and f"no preload schedule entry {e.id}" in r.get_data(as_text=True)


def test_apply_of_a_recommendation_that_changed_stores_nothing(app, admin, wanted, csrf_token):
    token = csrf_token(admin, "/preload")
    with services(app).sessions() as s:
        s.add(PreloadEntry(model_name=wanted, days="daily", at_minute=600, window_start_minute=615, window_end_minute=630,
                           evidence="earlier", applied_by="admin"))
        s.commit()
    for entries in ([f"{wanted}|weekdays|06:00"], [f"{wanted}|weekdays|06:15", "other|daily|07:00"], []):
        r = admin.post("/preload/apply", data={"csrf_token": token, "days": "14", "entry": entries})
        assert r.status_code == 409, entries
        assert "The recommendation changed since the page was shown" in r.get_data(as_text=True)
        assert "nothing was applied" in r.get_data(as_text=True)
    with services(app).sessions() as s:
        assert [(e.days, e.at_minute) for e in schedule(s)] == [("daily", 600)]
    # Without the CSRF token nothing is applied either.
    assert admin.post("/preload/apply", data={"days": "14", "entry": f"{wanted}|weekdays|06:15"}).status_code == 400


def test_too_little_data_shows_the_reason_and_no_apply(app, admin):
    svc = services(app)
    svc.preload.clock, svc.preload.tz = (lambda: NOW), TZ
    with svc.sessions() as s:
        s.add_all(RequestRecord(arrival_at=datetime(d.year, d.month, d.day, 6, 35, tzinfo=TZ).astimezone(UTC),
                                model=_gemma(app), status="ok") for d in DAYS[-2:])
        s.commit()
    html = admin.get("/preload").get_data(as_text=True)
    assert "Too little data for a recommendation: requests on 2 days of the last 14" in html
    assert "Apply:" not in html and "heat-cell" in html


@pytest.mark.parametrize(("days", "message"), [("2", "looks back 3 to 90 days (got 2)"), ("x", "&#39;x&#39; is not a whole number")])
def test_a_bad_lookback_is_a_400_that_says_the_bounds(admin, days, message):
    r = admin.get(f"/preload?days={days}")
    assert r.status_code == 400 and message in r.get_data(as_text=True)


def test_the_page_needs_the_admin(client):
    assert client.get("/preload").status_code == 302
