"""/metrics asks for an API token as the metrics_require_token setting says: by default from every
client but this machine's own, since which models and classes are busy tells who is home."""

import pytest

from app.gateway.context import services
from app.gateway.tokens import create_token, revoke_token
from app.store.settings import REGISTRY, set_setting

LAN = {"REMOTE_ADDR": "192.168.1.20"}
LOOPBACK = {"REMOTE_ADDR": "127.0.0.1"}


def require(app, value: str) -> None:
    hearth = services(app)
    with hearth.sessions() as s:
        set_setting(s, "metrics_require_token", value)
        s.commit()
    hearth.settings.invalidate()


@pytest.fixture
def token(app):
    with services(app).sessions() as s:
        token, info = create_token(s, "prometheus", "background")
        s.commit()
    return token, str(info.id)


def test_by_default_only_this_machine_reads_metrics_without_a_token(app, client, token):
    token, _ = token
    assert REGISTRY["metrics_require_token"].default == "off_machine"
    assert client.get("/metrics", environ_overrides=LOOPBACK).status_code == 200
    refused = client.get("/metrics", environ_overrides=LAN)
    assert refused.status_code == 401 and refused.headers["WWW-Authenticate"] == "Bearer"
    error = refused.get_json()["error"]
    assert error["code"] == "missing_token" and error["type"] == "authentication_error"
    assert "metrics_require_token" in error["message"] and "Authorization: Bearer" in error["message"]
    assert "hearth:" not in refused.get_data(as_text=True)
    ok = client.get("/metrics", environ_overrides=LAN, headers={"Authorization": f"Bearer {token}"})
    assert ok.status_code == 200 and "hearth:gateway_requests" in ok.get_data(as_text=True)


def test_always_asks_this_machine_too_and_refuses_bad_or_revoked_tokens(app, client, token):
    token, token_id = token
    require(app, "always")
    assert client.get("/metrics", environ_overrides=LOOPBACK).status_code == 401
    wrong = client.get("/metrics", headers={"Authorization": "Bearer hth_not_a_token"})
    assert wrong.status_code == 401 and wrong.get_json()["error"]["code"] == "invalid_token"
    assert client.get("/metrics", headers={"Authorization": f"Bearer {token}"}).status_code == 200
    with services(app).sessions() as s:
        revoke_token(s, token_id)
        s.commit()
    services(app).tokens.clear()
    assert client.get("/metrics", headers={"Authorization": f"Bearer {token}"}).status_code == 401


def test_never_leaves_metrics_open_to_everyone(app, client):
    require(app, "never")
    assert client.get("/metrics", environ_overrides=LAN).status_code == 200


def test_the_setting_is_on_the_settings_page_with_its_choices(app, admin):
    page = admin.get("/settings").get_data(as_text=True)
    assert "metrics_require_token" in page and "Token for /metrics" in page
    for choice in REGISTRY["metrics_require_token"].choices:
        assert choice in page
