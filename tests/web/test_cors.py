"""Browser apps on other origins and the API: CORS as api_cors_origins allows, never with the admin's cookie."""

import pytest

from app.gateway.context import services
from app.gateway.tokens import create_token
from app.store.settings import set_setting

APP_ORIGIN = "http://192.168.1.20:3000"
PREFLIGHT = {"Origin": APP_ORIGIN, "Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "authorization, content-type"}


def allow(app, value: str) -> None:
    hearth = services(app)
    with hearth.sessions() as s:
        set_setting(s, "api_cors_origins", value)
        s.commit()
    hearth.settings.invalidate()


@pytest.fixture
def auth(app):
    with services(app).sessions() as s:
        token, _ = create_token(s, "webapp", "chat")
        s.commit()
    return {"Authorization": f"Bearer {token}"}


def test_no_origin_is_allowed_by_default_and_the_preflight_says_which_setting(app, client, auth):
    r = client.options("/v1/chat/completions", headers=PREFLIGHT)
    assert r.status_code == 403 and "Access-Control-Allow-Origin" not in r.headers
    err = r.get_json()["error"]
    assert err["code"] == "origin_not_allowed" and "api_cors_origins" in err["message"] and APP_ORIGIN in err["message"]
    # An answer to a cross-origin call carries no CORS header: the page cannot read it.
    got = client.get("/v1/models", headers={**auth, "Origin": APP_ORIGIN})
    assert got.status_code == 200 and "Access-Control-Allow-Origin" not in got.headers


def test_a_listed_origin_gets_preflight_and_answers_without_credentials(app, client, auth):
    allow(app, "http://other.lan, " + APP_ORIGIN + "/")
    r = client.options("/v1/chat/completions", headers=PREFLIGHT)
    assert r.status_code == 204
    assert r.headers["Access-Control-Allow-Origin"] == APP_ORIGIN
    assert "POST" in r.headers["Access-Control-Allow-Methods"]
    assert r.headers["Access-Control-Allow-Headers"] == "authorization, content-type"
    assert "Access-Control-Allow-Credentials" not in r.headers and "Origin" in r.headers["Vary"]
    for path in ("/v1/models", "/api/tags"):  # OpenAI's and Ollama's surfaces alike
        got = client.get(path, headers={**auth, "Origin": APP_ORIGIN})
        assert got.status_code == 200 and got.headers["Access-Control-Allow-Origin"] == APP_ORIGIN
        assert "Access-Control-Allow-Credentials" not in got.headers
    # Errors are readable by the page too (it must see why), and other origins still are not allowed.
    bad = client.get("/v1/models", headers={"Origin": APP_ORIGIN})
    assert bad.status_code == 401 and bad.headers["Access-Control-Allow-Origin"] == APP_ORIGIN
    assert client.options("/v1/chat/completions", headers={**PREFLIGHT, "Origin": "http://evil.example"}).status_code == 403


def test_the_dashboard_never_answers_another_origin(app, admin):
    allow(app, "*")
    page = admin.get("/", headers={"Origin": APP_ORIGIN})
    assert "Access-Control-Allow-Origin" not in page.headers
    data = admin.get("/api/series", headers={"Origin": APP_ORIGIN})
    assert "Access-Control-Allow-Origin" not in data.headers
    # "*" for the API: a browser sends no cookie with a credentialed call to it, nor may the page read one.
    r = admin.options("/v1/chat/completions", headers=PREFLIGHT)
    assert r.status_code == 204 and r.headers["Access-Control-Allow-Origin"] == "*"
    assert "Access-Control-Allow-Credentials" not in r.headers


@pytest.mark.parametrize("value", ["192.168.1.20:3000", "http://x.lan/path", "ftp://x.lan"])
def test_a_bad_origin_is_refused_with_the_form_to_write(app, value):
    from app.store.settings import Invalid, validate

    with pytest.raises(Invalid, match="scheme://host"):
        validate("api_cors_origins", value)
