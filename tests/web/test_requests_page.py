"""The Requests page: filters, keyset pagination, partial for htmx, empty states, bad filters."""

import re
from datetime import UTC, datetime, timedelta

import pytest

from app.gateway.context import services
from app.store.models import RequestRecord

NOW = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)
ROW = re.compile(r"<tr>\s*<td class=\"small\">([0-9: -]+)</td>")


@pytest.fixture
def app(app):
    """The dashboard with its clock fixed at NOW."""
    app.config["HEARTH_CLOCK"] = lambda: NOW.timestamp()
    return app


def _fill(app, n=130):
    """n requests one minute apart, newest at NOW - 1 min; every 10th is bob's error on 'other'."""
    rows = []
    for i in range(n):
        bob = i % 10 == 0
        rows.append(RequestRecord(
            arrival_at=NOW - timedelta(minutes=i + 1), member_name="bob" if bob else "alice",
            class_name="voice" if i % 2 else "chat", model="other" if bob else "gemma", status="error" if bob else "ok",
            http_status=502 if bob else 200, error="runner crashed" if bob else None, ttft_ms=100.0 + i, tpot_ms=20.0,
            total_ms=900.0, prompt_tokens=10, completion_tokens=20, queue_ms=1.0))
    with services(app).sessions() as s:
        s.add_all(rows)
        s.commit()


def _times(html):
    return ROW.findall(html)


def test_empty_log_says_how_to_get_requests(admin):
    r = admin.get("/requests")
    assert r.status_code == 200
    html = r.get_data(as_text=True)
    assert "No requests yet" in html and "Create a token" in html and 'name="member"' in html


def test_pages_newest_first_with_keyset_cursors(app, admin):
    _fill(app)
    first = admin.get("/requests").get_data(as_text=True)
    times = _times(first)
    assert len(times) == 50 and times == sorted(times, reverse=True)
    assert times[0] == (NOW - timedelta(minutes=1)).strftime("%Y-%m-%d %H:%M:%S")
    assert "Newer" not in first and "130 in the log" in first
    older = re.search(r'href="(/requests\?before=[^"]+)"', first).group(1).replace("&amp;", "&")
    second = admin.get(older).get_data(as_text=True)
    times2 = _times(second)
    assert len(times2) == 50 and times2[0] < times[-1]
    newer = re.search(r'href="(/requests\?after=[^"]+)"', second).group(1).replace("&amp;", "&")
    assert _times(admin.get(newer).get_data(as_text=True)) == times
    third = admin.get(re.search(r'href="(/requests\?before=[^"]+)"', second).group(1).replace("&amp;", "&"))
    assert len(_times(third.get_data(as_text=True))) == 30 and "Older" not in third.get_data(as_text=True)


def test_filters_combine_and_survive_paging(app, admin):
    _fill(app)
    html = admin.get("/requests?member=bob&status=error").get_data(as_text=True)
    assert len(_times(html)) == 13 and "alice" not in html.split("<tbody>")[1] and "runner crashed" in html
    assert len(_times(admin.get("/requests?class=voice&model=gemma").get_data(as_text=True))) == 50
    # The last hour holds the 60 newest; the older link keeps the filter.
    hour = admin.get("/requests?range=1h").get_data(as_text=True)
    assert len(_times(hour)) == 50
    older = re.search(r'href="(/requests\?before=[^"]+)"', hour).group(1).replace("&amp;", "&")
    assert "range=1h" in older
    assert len(_times(admin.get(older).get_data(as_text=True))) == 10


def test_no_match_and_bad_filters(app, admin):
    _fill(app, 5)
    html = admin.get("/requests?member=nobody").get_data(as_text=True)
    assert "No requests match these filters" in html and "holds 5 requests" in html
    r = admin.get("/requests?status=exploded&member=alice")
    assert r.status_code == 400
    body = r.get_data(as_text=True)
    assert "unknown status &#39;exploded&#39;" in body and 'value="alice" selected' in body
    r = admin.get("/requests?before=yesterday")
    assert r.status_code == 400 and "is not a page cursor" in r.get_data(as_text=True)
    assert admin.get("/requests?range=forever").status_code == 400


def test_htmx_filter_returns_only_the_log(app, admin):
    _fill(app, 5)
    r = admin.get("/requests?class=chat", headers={"HX-Request": "true", "HX-Target": "request-log"})
    html = r.get_data(as_text=True)
    assert r.status_code == 200 and html.startswith('<section class="card" id="request-log">') and "<form" not in html
    assert len(_times(html)) == 3


def test_needs_login(client):
    assert client.get("/requests").status_code == 302


def test_a_request_with_images_shows_their_count_and_encode_time(app, admin):
    with services(app).sessions() as s:
        s.add_all([
            RequestRecord(arrival_at=NOW - timedelta(minutes=1), member_name="alice", class_name="chat", model="cam",
                          status="ok", http_status=200, prompt_tokens=300, completion_tokens=5, images=2,
                          image_encode_ms=1234.56),
            RequestRecord(arrival_at=NOW - timedelta(minutes=2), member_name="alice", class_name="chat", model="text",
                          status="ok", http_status=200, prompt_tokens=30, completion_tokens=5)])
        s.commit()
    html = admin.get("/requests").get_data(as_text=True)
    assert re.search(r'2 images · <span class="image-encode-ms">1,234.6</span> ms encode', html)
    assert html.count('class="small muted images"') == 1  # the text request shows no images line


def test_a_speech_request_shows_its_characters_audio_and_real_time_factor(app, admin):
    with services(app).sessions() as s:
        s.add(RequestRecord(arrival_at=NOW - timedelta(minutes=1), member_name="kid", class_name="voice",
                            model="en_US-joe-medium", status="ok", http_status=200, features="speech", input_chars=48,
                            audio_seconds=3.0, ttft_ms=250.0, total_ms=600.0))
        s.commit()
    html = admin.get("/requests").get_data(as_text=True)
    assert '<span class="speech-chars">48</span> characters spoken' in html
    assert re.search(r'<span class="audio-seconds">3.0</span> s audio · RTF <span class="audio-rtf">0.20</span>', html)
