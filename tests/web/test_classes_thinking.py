"""The Classes page's thinking default: shown, edited with a choice of model/off/on, a bad value refused inline."""

from __future__ import annotations

import html as htmllib

from app.gateway.context import services
from app.store.models import RequestClass

FIELDS = ("priority", "ttft_target_ms", "tpot_target_ms", "default_max_tokens", "max_output_tokens", "max_concurrent",
          "max_queue", "weight", "queue_timeout_s")


def _class(app, name: str) -> RequestClass:
    with services(app).sessions() as s:
        return s.get(RequestClass, name)


def _form(app, name: str, **changes) -> dict:
    row = _class(app, name)
    values = {f: str(getattr(row, f)) for f in FIELDS}
    values.update({"default_model": row.default_model or "", "thinking": row.thinking, **changes})
    return values


def test_the_table_shows_each_classs_thinking_and_the_form_offers_the_three(app, admin):
    page = admin.get("/classes").get_data(as_text=True)
    voice_row = page[page.index('id="class-voice"'):]
    assert ">off</span>" in voice_row[:voice_row.index("</tr>")]
    form = admin.get("/classes/voice/edit", headers={"HX-Request": "true"}).get_data(as_text=True)
    assert '<select name="thinking"' in form
    assert '<option value="off" selected>' in form and '<option value="model">' in form and '<option value="on">' in form


def test_saving_thinking_applies_to_the_gateway_at_once(app, admin, csrf_token):
    hearth = services(app)
    assert hearth.classes.get("chat").thinking == "model"
    data = _form(app, "chat", thinking="on", csrf_token=csrf_token(admin, "/classes"))
    r = admin.post("/classes/chat", data=data, headers={"HX-Request": "true"})
    assert r.status_code == 200, r.get_data(as_text=True)
    assert _class(app, "chat").thinking == "on" and hearth.classes.get("chat").thinking == "on"


def test_an_unknown_thinking_value_is_refused_and_nothing_saved(app, admin, csrf_token):
    data = _form(app, "voice", thinking="sometimes", csrf_token=csrf_token(admin, "/classes"))
    r = admin.post("/classes/voice", data=data, headers={"HX-Request": "true"})
    assert r.status_code == 422
    assert "'sometimes' is not a valid thinking: enter one of model, off, on" in htmllib.unescape(r.get_data(as_text=True))
    assert _class(app, "voice").thinking == "off"
