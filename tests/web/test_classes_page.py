"""The Classes page: table, figures over a range, inline edit with validation, CSRF."""

import html as htmllib
from datetime import UTC, datetime, timedelta

import pytest

from app.gateway.context import services
from app.store.models import RequestClass, RequestRecord

NOW = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)


@pytest.fixture
def app(app):
    """The dashboard with its clock fixed at NOW (SLO windows are computed against it)."""
    app.config["HEARTH_CLOCK"] = lambda: NOW.timestamp()
    return app


def _request(klass, minutes_ago, ttft, tpot, tokens, status="ok"):
    return RequestRecord(arrival_at=NOW - timedelta(minutes=minutes_ago), class_name=klass, status=status,
                         ttft_ms=ttft, tpot_ms=tpot, completion_tokens=tokens, member_name="alice", model="m")


def _add(app, *rows):
    with services(app).sessions() as s:
        s.add_all(rows)
        s.commit()


def _class(app, name):
    with services(app).sessions() as s:
        return s.get(RequestClass, name)


def test_lists_every_class_and_says_what_to_do_without_requests(admin):
    page = admin.get("/classes")
    assert page.status_code == 200
    html = page.get_data(as_text=True)
    for name in ("voice", "chat", "documents", "coding", "background"):
        assert f'id="class-{name}"' in html
    assert "No requests in the last 24 hours" in html and "Create a token" in html


def test_slo_attainment_and_fairness_over_the_chosen_range(app, admin):
    voice = _class(app, "voice")
    _add(app,
         _request("voice", 10, voice.ttft_target_ms - 1, 1, 40),
         _request("voice", 20, voice.ttft_target_ms + 1, 1, 40),       # too slow to first token
         _request("chat", 30, 10, 1, 40),
         _request("chat", 60 * 30, 10, 1, 4000))                       # 30 h ago: only in 7 d
    html = admin.get("/classes?range=24h").get_data(as_text=True)
    row = html[html.index('id="class-voice"'):html.index('id="class-chat"')]
    assert "50.0 %" in row  # one of two voice requests met its targets
    weights = {c: _class(app, c).weight for c in ("voice", "chat")}
    service = [40 * 2 / weights["voice"], 40 / weights["chat"]]
    jain = sum(service) ** 2 / (2 * sum(x * x for x in service))
    assert f"{jain:,.2f}" in html and "over 2 classes with demand" in html
    week = admin.get("/classes?range=7d").get_data(as_text=True)
    assert "4</div>" in week  # the Requests tile counts the 30-hour-old request too


def test_preemptions_are_counted_per_class(app, admin):
    preempted = _request("background", 5, 10, 1, 40)
    preempted.num_preemptions = 3
    _add(app, preempted, _request("background", 6, 10, 1, 40), _request("voice", 7, 10, 1, 8))
    html = admin.get("/classes?range=1h").get_data(as_text=True)
    row = html[html.index('id="class-background"'):]
    cells = row[:row.index("</tr>")].split('<td class="right">')
    assert cells[-4].startswith("2<") and cells[-3].startswith("3<")  # 2 requests, preempted 3 times


def test_unknown_range_is_a_clear_400(admin):
    page = admin.get("/classes?range=1y")
    assert page.status_code == 400
    assert "range must be one of 1h, 24h, 7d" in page.get_data(as_text=True)


def test_edit_form_partial_and_full_page(admin):
    partial = admin.get("/classes/voice/edit", headers={"HX-Request": "true"})
    assert partial.status_code == 200
    html = partial.get_data(as_text=True)
    assert "<html" not in html and 'name="ttft_target_ms"' in html
    full = admin.get("/classes/voice/edit")
    assert "<html" in full.get_data(as_text=True) and 'id="class-form"' in full.get_data(as_text=True)
    assert admin.get("/classes/nope/edit").status_code == 404


def _form(app, name, **changes):
    row = _class(app, name)
    values = {f: str(getattr(row, f)) for f in ("priority", "ttft_target_ms", "tpot_target_ms", "default_max_tokens",
                                                 "max_output_tokens", "max_concurrent", "max_queue", "weight",
                                                 "queue_timeout_s")}
    values["default_model"] = row.default_model or ""
    if row.preemptible:
        values["preemptible"] = "yes"
    values.update(changes)
    return {k: v for k, v in values.items() if v is not None}


def test_save_persists_and_applies_to_the_gateway_at_once(app, admin, csrf_token):
    hearth = services(app)
    assert hearth.classes.get("chat").ttft_target_ms != 777
    data = _form(app, "chat", ttft_target_ms="777", weight="2.5", preemptible="yes", csrf_token=csrf_token(admin, "/classes"))
    r = admin.post("/classes/chat", data=data, headers={"HX-Request": "true"})
    assert r.status_code == 200
    html = r.get_data(as_text=True)
    assert 'hx-swap-oob="true"' in html and "Class <strong>chat</strong> saved" in html and "777 / " in html
    row = _class(app, "chat")
    assert (row.ttft_target_ms, row.weight, row.preemptible) == (777, 2.5, True)
    assert hearth.classes.get("chat").ttft_target_ms == 777  # registry cache dropped
    # Without JavaScript: a redirect back to the table; an unticked checkbox means "no".
    data = _form(app, "chat", preemptible=None, csrf_token=csrf_token(admin, "/classes"))
    data.pop("preemptible", None)
    r = admin.post("/classes/chat", data=data)
    assert r.status_code == 302 and "saved=chat" in r.headers["Location"]
    assert _class(app, "chat").preemptible is False


def test_bad_input_comes_back_inline_and_nothing_is_saved(app, admin, csrf_token):
    before = _class(app, "voice")
    data = _form(app, "voice", ttft_target_ms="fast", weight="0", default_max_tokens="99999",
                 default_model="no-such-model", csrf_token=csrf_token(admin, "/classes"))
    r = admin.post("/classes/voice", data=data, headers={"HX-Request": "true"})
    assert r.status_code == 422
    html = htmllib.unescape(r.get_data(as_text=True))
    assert "'fast' is not a valid ttft_target_ms" in html
    assert "fair-share weight must be at least" in html
    assert "is above max output tokens" in html
    assert "no model 'no-such-model'" in html
    assert 'value="fast"' in html and 'value="no-such-model"' in html  # what was typed is kept
    after = _class(app, "voice")
    assert (after.ttft_target_ms, after.weight, after.default_max_tokens) == (
        before.ttft_target_ms, before.weight, before.default_max_tokens)
    full = admin.post("/classes/voice", data=data)
    assert full.status_code == 422 and "<html" in full.get_data(as_text=True)


def test_default_model_accepts_a_catalog_name(app, admin, csrf_token):
    name = services(app).catalog.entries[0].name
    data = _form(app, "coding", default_model=name, csrf_token=csrf_token(admin, "/classes"))
    assert admin.post("/classes/coding", data=data).status_code == 302
    assert _class(app, "coding").default_model == name


def test_save_needs_the_csrf_token_and_a_login(app, admin, client):
    data = _form(app, "voice", ttft_target_ms="1")
    assert admin.post("/classes/voice", data=data).status_code == 400
    assert _class(app, "voice").ttft_target_ms != 1
    assert client.get("/classes").status_code == 302
    assert client.post("/classes/voice", data=data).status_code in (302, 400)


def test_a_tpot_target_the_hardware_cannot_keep_is_marked_with_the_figure(app, admin):
    model = services(app).catalog.default_model_name()
    assert "out of reach" not in admin.get("/classes").get_data(as_text=True)  # nothing measured yet
    services(app).sampler.latest = {f"runner:{model}@local": {
        "prefill_budget": 64.0, "full_batch_tpot_ms": 173.3, "full_batch_decode_ms": 60.0, "prefill_token_ms": 1.5,
        "prefill_knee": 64.0}}
    html = admin.get("/classes").get_data(as_text=True)
    row = {name: html.split(f'id="class-{name}"', 1)[1].split("</tr>", 1)[0] for name in ("voice", "documents")}
    assert "TPOT out of reach" in row["voice"] and "a full batch keeps 173 ms" in row["voice"]
    assert "out of reach" not in row["documents"]
