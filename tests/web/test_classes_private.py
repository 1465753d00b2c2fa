"""The Classes page marks a class private (its prompts never written to the runners' KV disk tier)."""

from app.gateway.context import services
from tests.helpers import class_form


def test_a_class_is_marked_private_on_the_classes_page(app, admin, csrf_token):
    hearth = services(app)
    assert hearth.classes.get("chat").private is False
    form = admin.get("/classes/chat/edit", headers={"HX-Request": "true"}).get_data(as_text=True)
    assert '<select name="private"' in form and "never written to the KV cache on the data volume" in form
    data = class_form(app, "chat", private="on", csrf_token=csrf_token(admin, "/classes"))
    assert admin.post("/classes/chat", data=data, headers={"HX-Request": "true"}).status_code == 200
    assert hearth.classes.get("chat").private is True
    form = admin.get("/classes/chat/edit", headers={"HX-Request": "true"}).get_data(as_text=True)
    assert '<option value="on" selected>yes (never on disk)' in form
    # A form of an older page, without the field, leaves it as it is.
    data = {k: v for k, v in class_form(app, "chat", csrf_token=csrf_token(admin, "/classes")).items() if k != "private"}
    assert admin.post("/classes/chat", data=data, headers={"HX-Request": "true"}).status_code == 200
    assert hearth.classes.get("chat").private is True
    bad = class_form(app, "chat", private="perhaps", csrf_token=csrf_token(admin, "/classes"))
    assert admin.post("/classes/chat", data=bad, headers={"HX-Request": "true"}).status_code == 422
