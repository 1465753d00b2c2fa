"""Speculative decoding on the dashboard: the Models page's per-model setting, the Classes page's switch, the
runner's decision and each class's drafts kept on the Overview, and each request's drafts in the log."""

from __future__ import annotations

import html as htmllib
from datetime import UTC, datetime, timedelta

from sqlalchemy import select

from app.engine.speculation import LOOKUP_DRAFT_MAX
from app.gateway.context import services
from app.residency.manager import ModelState
from app.store.models import Model, RequestClass, RequestRecord, RunnerSettings
from tests.helpers import class_form

NOTE = "standing aside: 6 sequences decode (drafts above 4 cost the batch)"
CLASS_FIELDS = ("priority", "ttft_target_ms", "tpot_target_ms", "default_max_tokens", "max_output_tokens",
                "max_concurrent", "max_queue", "weight", "queue_timeout_s")


def _model(app) -> str:
    return next(iter(services(app).catalog.model_specs()))


def _post(admin, csrf_token, url, page, **data):
    return admin.post(url, data={**data, "csrf_token": csrf_token(admin, page)}, headers={"HX-Request": "true"})


def _stored_setting(app, name):
    with services(app).sessions() as s:
        model_id = s.scalar(select(Model.id).where(Model.name == name))
        return s.scalar(select(RunnerSettings.speculation).where(RunnerSettings.model_id == model_id))


# -- Models ----------------------------------------------------------------------------------------------


def test_the_models_card_offers_the_setting_with_what_it_does(app, admin):
    name = _model(app)
    page = htmllib.unescape(admin.get("/models").get_data(as_text=True))
    assert "Speculative decoding" in page and '<select name="speculation"' in page
    assert '<option value="auto" selected>Auto: n-gram lookup' in page
    assert '<option value="off">Off: never draft' in page and '<option value="ngram-mod">' in page
    assert "stands aside when the batch fills" in page and "Applies when the model's runner next starts" in page
    # Unset is auto: a hearth runner drafts with ngram-lookup, and the estimate carries its draft rows.
    assert f"hearth runner: <code>--spec-type ngram-lookup</code>, up to {LOOKUP_DRAFT_MAX} draft tokens" in page
    assert f"(with {LOOKUP_DRAFT_MAX} draft rows)" in page
    assert services(app).catalog.model_specs()[name].runner.spec_type == "ngram-lookup"


def test_saving_the_setting_round_trips_and_reaches_the_runner_spec(app, admin, csrf_token):
    name = _model(app)
    estimate_on = services(app).catalog.model_specs()[name].estimate_bytes
    r = _post(admin, csrf_token, f"/models/{name}/speculation", "/models", speculation="off")
    assert r.status_code == 200, r.get_data(as_text=True)
    body = htmllib.unescape(r.get_data(as_text=True))
    assert "Saved: speculative decoding off." in body
    assert '<option value="off" selected>' in body and "<code>--spec-type none</code> (never drafts)" in body
    assert _stored_setting(app, name) == "off"
    spec = services(app).catalog.model_specs()[name]
    assert spec.runner.spec_type == "none" and spec.estimate_bytes < estimate_on
    # Back to auto: stored as NULL, so the model follows what auto means.
    assert _post(admin, csrf_token, f"/models/{name}/speculation", "/models", speculation="ngram-mod").status_code == 200
    assert _stored_setting(app, name) == "ngram-mod"
    assert _post(admin, csrf_token, f"/models/{name}/speculation", "/models", speculation="auto").status_code == 200
    assert _stored_setting(app, name) is None
    assert services(app).catalog.model_specs()[name].runner.spec_type == "ngram-lookup"


def test_a_setting_that_cannot_be_is_refused_on_the_card(app, admin, csrf_token):
    name = _model(app)
    r = _post(admin, csrf_token, f"/models/{name}/speculation", "/models", speculation="draft-simple")
    assert r.status_code == 422
    assert "Choose one of: auto, off, ngram-lookup" in htmllib.unescape(r.get_data(as_text=True))
    # Hearth's own type on a stock llama-server runner is refused by name.
    with services(app).sessions() as s:
        model_id = s.scalar(select(Model.id).where(Model.name == name))
        s.add(RunnerSettings(model_id=model_id, kind="llama-server", binary_path="/opt/llama-server"))
        s.commit()
    services(app).catalog.rescan()
    r = _post(admin, csrf_token, f"/models/{name}/speculation", "/models", speculation="ngram-lookup")
    assert r.status_code == 422 and "ngram-lookup is Hearth&#39;s own" in r.get_data(as_text=True)
    assert _stored_setting(app, name) is None
    page = htmllib.unescape(admin.get("/models").get_data(as_text=True))
    assert "llama-server runner: no <code>--spec-type</code> (its own default)" in page


def test_saving_the_setting_needs_csrf(app, admin):
    assert admin.post(f"/models/{_model(app)}/speculation", data={"speculation": "off"}).status_code == 400


# -- Classes ---------------------------------------------------------------------------------------------




def test_the_class_switch_round_trips_and_applies_to_the_gateway(app, admin, csrf_token):
    hearth = services(app)
    assert hearth.classes.get("background").speculation is True
    form = admin.get("/classes/background/edit", headers={"HX-Request": "true"}).get_data(as_text=True)
    assert '<select name="speculation"' in form and '<option value="on" selected>' in form
    data = class_form(app, "background", speculation="off", csrf_token=csrf_token(admin, "/classes"))
    assert admin.post("/classes/background", data=data, headers={"HX-Request": "true"}).status_code == 200
    assert hearth.classes.get("background").speculation is False
    form = admin.get("/classes/background/edit", headers={"HX-Request": "true"}).get_data(as_text=True)
    assert '<option value="off" selected>' in form
    # A form of an older page, without the field, leaves the switch as it is.
    data = class_form(app, "background", weight="2", csrf_token=csrf_token(admin, "/classes"))
    assert admin.post("/classes/background", data=data, headers={"HX-Request": "true"}).status_code == 200
    assert hearth.classes.get("background").speculation is False and hearth.classes.get("background").weight == 2
    page = admin.get("/classes").get_data(as_text=True)
    row = page[page.index('id="class-background"'):]
    assert ">off</span>" in row[:row.index("</tr>")].split('class="class-drafts"')[1]


def test_a_bad_switch_value_is_refused_inline(app, admin, csrf_token):
    data = class_form(app, "chat", speculation="sometimes", csrf_token=csrf_token(admin, "/classes"))
    r = admin.post("/classes/chat", data=data, headers={"HX-Request": "true"})
    assert r.status_code == 422
    assert "'sometimes' is not a valid speculation: enter yes or no" in htmllib.unescape(r.get_data(as_text=True))
    assert services(app).classes.get("chat").speculation is True


def _log(app, class_name, drafted, kept, minutes_ago=1):
    with services(app).sessions() as s:
        s.add(RequestRecord(arrival_at=datetime.now(UTC) - timedelta(minutes=minutes_ago), class_name=class_name,
                            model=_model(app), status="ok", prompt_tokens=10, completion_tokens=20,
                            draft_tokens=drafted, draft_accepted=kept))
        s.commit()


def test_the_classes_page_shows_the_share_of_drafts_kept(app, admin):
    _log(app, "coding", 40, 30)
    _log(app, "coding", 10, 5)
    page = admin.get("/classes?range=1h").get_data(as_text=True)
    row = page[page.index('id="class-coding"'):]
    assert "70 % kept" in row[:row.index("</tr>")] and "35 of 50 draft tokens kept, 2 requests" in row


# -- Overview --------------------------------------------------------------------------------------------


def _ready(app, name):
    """The model as the residency manager reports a ready runner (nothing is started)."""
    residency = services(app).residency
    real = residency.status

    def status():
        return [{**m, "state": ModelState.READY} if m["name"] == name else m for m in real()]

    residency.status = status


def test_the_overview_shows_each_runners_decision_beside_the_policy(app, admin):
    name = _model(app)
    _ready(app, name)
    sampler = services(app).sampler
    source = f"runner:{name}@local"
    html = htmllib.unescape(admin.get("/partials/overview/policy").get_data(as_text=True))
    assert "Speculative decoding" in html and "ngram-lookup" in html and "decision not read yet" in html
    # The rule, folded under "how this works" in short sentences, still names the threshold the runner uses.
    assert "Speculative decoding guesses tokens" in html and "more than 4 answers are written" in html
    sampler.speculation.note(source, 0.0, {"enabled": True, "type": "ngram-lookup", "drafting": False, "note": NOTE,
                                           "acceptance": 0.625, "by_class": {}})
    sampler.latest = {source: {"spec_drafting": 0.0}}
    html = htmllib.unescape(admin.get("/partials/overview/policy").get_data(as_text=True))
    decision = html[html.index('class="spec-decision"'):]
    decision = decision[:decision.index("</dd>")]
    assert "standing aside" in decision and NOTE in decision and "62 % kept" in decision
    sampler.latest = {source: {"spec_drafting": 1.0}}
    sampler.speculation.note(source, 5.0, {"enabled": True, "type": "ngram-lookup", "drafting": True,
                                           "note": "drafting", "acceptance": None, "by_class": {}})
    html = admin.get("/partials/overview/policy").get_data(as_text=True)
    decision = html[html.index('class="spec-decision"'):]
    assert ">drafting</span>" in decision[:decision.index("</dd>")]
    # The whole page renders the same panel.
    assert "spec-decision" in admin.get("/").get_data(as_text=True)


def test_the_overview_shows_drafts_kept_per_class_over_its_range(app, admin):
    _log(app, "chat", 20, 15, minutes_ago=2)
    _log(app, "chat", 100, 0, minutes_ago=30)  # inside 1 h, outside 5 min
    five = admin.get("/partials/overview/policy?range=5m").get_data(as_text=True)
    hour = admin.get("/partials/overview/policy?range=1h").get_data(as_text=True)

    def chat_cell(html):
        row = html[html.index(">chat<"):]
        return row[row.index('class="right class-acceptance"'):row.index("</tr>")]

    assert "75 %" in chat_cell(five) and "15 of 20 draft tokens, 1 request" in chat_cell(five)
    assert "12 %" in chat_cell(hour)
    # A class switched off says so instead of a figure; the panel polls with the page's range.
    with services(app).sessions() as s:
        s.get(RequestClass, "chat").speculation = False
        s.commit()
    services(app).classes.invalidate()
    assert ">off<" in chat_cell(admin.get("/partials/overview/policy?range=5m").get_data(as_text=True))
    page = admin.get("/?range=1h").get_data(as_text=True)
    assert "hearth:range from:document" in page and 'Hearth.range) || "1h"' in page
    assert "spec_draft_tok_s,spec_accepted_tok_s" in page


# -- Requests --------------------------------------------------------------------------------------------


def test_the_request_log_shows_each_requests_drafts(app, admin):
    _log(app, "coding", 40, 31)
    _log(app, "voice", None, None)
    page = admin.get("/requests").get_data(as_text=True)
    assert page.count("drafts kept</div>") == 1 and "31 / 40 drafts kept" in page
