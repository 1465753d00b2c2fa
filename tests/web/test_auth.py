"""Admin setup, login, logout, session cookie flags, CSRF, rate limiting, and that every dashboard
route is closed to anonymous visitors."""

import os
import stat
import threading

import pytest

from app.gateway.context import services
from app.secrets import read_secret
from tests.helpers import ServeStarter, dashboard_app, setup_code, wait_until

# Blueprints anyone may reach: the login pages, the API (its own bearer tokens), vendor files, the
# default model's first-run progress (shown on /setup; see test_default_model_progress.py).
# The OpenAI and Ollama APIs authenticate by bearer token, not by the dashboard login.
PUBLIC_BLUEPRINTS = ("auth", "gateway", "ollama", "assets", "progress")
# /status decides for itself (the status_public setting); see test_status.py.
PUBLIC_PATHS = ("/status",)


def dashboard_routes(app) -> list[str]:
    """Every GET route without URL arguments that belongs to the dashboard."""
    out = []
    for rule in app.url_map.iter_rules():
        if "GET" not in rule.methods or rule.arguments or rule.endpoint == "static":
            continue
        if rule.endpoint.partition(".")[0] in PUBLIC_BLUEPRINTS or rule.rule in PUBLIC_PATHS:
            continue
        out.append(rule.rule)
    return sorted(out)


def test_first_run_sends_every_dashboard_page_to_setup(app, client):
    routes = dashboard_routes(app)
    assert "/" in routes and "/api/series" in routes
    for path in routes:
        response = client.get(path)
        if path.startswith("/api/"):
            assert response.status_code == 401, path
            assert response.get_json()["login"] == "/setup"
        else:
            assert response.status_code == 302, path
            assert response.headers["Location"] == "/setup", path
    assert client.get("/login").headers["Location"] == "/setup"


def test_setup_stores_a_hash_and_logs_in(app, client, admin_password, csrf_token, set_up_admin):
    response = set_up_admin(client)
    assert response.headers["Location"] == "/"
    data = services(app).data_dir
    stored = read_secret(data, "admin_password")
    assert stored and admin_password not in stored and stored.startswith("scrypt:")
    mode = stat.S_IMODE(os.stat(data / "secrets" / "admin_password").st_mode)
    assert mode == 0o600
    assert client.get("/").status_code == 200
    # Once a password exists, /setup cannot replace it.
    assert client.get("/setup").headers["Location"] == "/login"
    again = client.post("/setup", data={"password": "x" * 12, "confirm": "x" * 12,
                                        "csrf_token": csrf_token(client, "/")})
    assert again.status_code == 302 and read_secret(data, "admin_password") == stored


@pytest.mark.parametrize(("password", "confirm", "message"), [
    ("short", "short", "at least 8"),
    ("long enough 1", "long enough 2", "differ"),
])
def test_setup_refuses_bad_passwords(app, client, password, confirm, message, csrf_token):
    token = csrf_token(client, "/setup")
    response = client.post("/setup", data={"password": password, "confirm": confirm, "csrf_token": token,
                                           "setup_code": setup_code(services(app).data_dir)})
    assert response.status_code == 400
    assert message in response.get_data(as_text=True)
    assert read_secret(services(app).data_dir, "admin_password") is None


def test_setup_asks_for_the_one_time_code_and_drops_it_once_used(app, client, admin_password, csrf_token):
    data = services(app).data_dir
    token = csrf_token(client, "/setup")
    page = client.get("/setup").get_data(as_text=True)
    assert 'name="setup_code"' in page and str(data / "secrets" / "setup_code") in page
    code_file = data / "secrets" / "setup_code"
    assert stat.S_IMODE(code_file.stat().st_mode) == 0o600
    code = setup_code(data)
    form = {"password": admin_password, "confirm": admin_password, "csrf_token": token}
    for wrong in ("", "abcd-efgh-jkmn", code + "x"):
        refused = client.post("/setup", data={**form, "setup_code": wrong})
        assert refused.status_code == 403 and "not the setup code" in refused.get_data(as_text=True)
        assert read_secret(data, "admin_password") is None
    # Case, spaces and dashes are forgiven: it is typed by hand from a log.
    accepted = client.post("/setup", data={**form, "setup_code": " " + code.upper().replace("-", " ") + " "})
    assert accepted.status_code == 302 and read_secret(data, "admin_password")
    assert not code_file.exists()
    # The used code opens nothing any more, and no new one is made while the admin exists.
    stranger = app.test_client()
    again = stranger.post("/setup", data={**form, "setup_code": code, "csrf_token": csrf_token(stranger)})
    assert again.headers["Location"] == "/login" and stranger.get("/").status_code == 302
    assert not code_file.exists()


def test_two_simultaneous_setups_make_exactly_one_admin(app, admin_password, csrf_token, monkeypatch):
    """Both posts pass every check before either stores its password: only one may become the admin."""
    from app.web import auth

    data = services(app).data_dir
    both_hashing = threading.Barrier(2, timeout=10)
    real_hash = auth.generate_password_hash

    def hash_when_both_are_here(password):
        both_hashing.wait()
        return real_hash(password)

    monkeypatch.setattr(auth, "generate_password_hash", hash_when_both_are_here)
    clients = [app.test_client(), app.test_client()]
    forms = [{"password": f"{admin_password} {i}", "confirm": f"{admin_password} {i}",
              "csrf_token": csrf_token(c, "/setup"), "setup_code": setup_code(data)} for i, c in enumerate(clients)]
    responses = [None, None]

    def post(i):
        responses[i] = clients[i].post("/setup", data=forms[i])

    threads = [threading.Thread(target=post, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    codes = sorted(r.status_code for r in responses)
    assert codes == [302, 409], codes
    winner = 0 if responses[0].status_code == 302 else 1
    loser = responses[1 - winner].get_data(as_text=True)
    assert "Another browser created the admin password" in loser and 'href="/login"' in loser
    # The winner's password is the one stored, and only the winner is logged in.
    assert auth.check_password_hash(read_secret(data, "admin_password"), forms[winner]["password"])
    assert clients[winner].get("/").status_code == 200
    assert clients[1 - winner].get("/").status_code == 302


def test_serve_log_says_which_url_to_open_and_gives_the_setup_code(tmp_path_factory, standin_model):
    starter = ServeStarter(tmp_path_factory.mktemp, standin_model)
    try:
        served = starter()
        wait_until(lambda: "listening:" in served.log_path.read_text(), 30, "serve logged no listen address")
        log = served.log_path.read_text()
        assert f"the dashboard is at {served.url}/" in log
        code = setup_code(served.data)
        assert f"open {served.url}/setup in a browser and enter the setup code {code}" in log
        assert str(served.data / "secrets" / "setup_code") in log
    finally:
        starter.stop_all()


def test_login_logout_and_wrong_password(app, client, admin_password, csrf_token, set_up_admin):
    set_up_admin(client)
    client.post("/logout", data={"csrf_token": csrf_token(client, "/")})
    assert client.get("/").headers["Location"].startswith("/login")
    wrong = client.post("/login", data={"password": "nope", "csrf_token": csrf_token(client)})
    assert wrong.status_code == 401 and "Wrong password" in wrong.get_data(as_text=True)
    assert client.get("/").status_code == 302
    ok = client.post("/login", data={"password": admin_password, "next": "/?range=1h",
                                     "csrf_token": csrf_token(client)})
    assert ok.status_code == 302 and ok.headers["Location"] == "/?range=1h"
    assert client.get("/").status_code == 200


def test_next_never_leaves_the_site(client, admin_password, csrf_token, set_up_admin):
    set_up_admin(client)
    client.post("/logout", data={"csrf_token": csrf_token(client, "/")})
    for target in ("https://evil.example/", "//evil.example/x", "javascript:alert(1)"):
        response = client.post("/login", data={"password": admin_password, "next": target,
                                               "csrf_token": csrf_token(client)})
        assert response.headers["Location"] == "/", target
        client.post("/logout", data={"csrf_token": csrf_token(client, "/")})


def test_anonymous_request_goes_to_login_with_next(client, csrf_token, set_up_admin):
    set_up_admin(client)
    client.post("/logout", data={"csrf_token": csrf_token(client, "/")})
    assert client.get("/?range=24h").headers["Location"] == "/login?next=/?range%3D24h"
    htmx = client.get("/partials/overview/tiles", headers={"HX-Request": "true"})
    assert htmx.status_code == 401 and htmx.headers["HX-Redirect"].startswith("/login")
    api = client.get("/api/series?metric=cpu_pct")
    assert api.status_code == 401 and api.get_json()["error"] == "login required"


def test_session_cookie_flags_plain_http_and_https(client, admin_password, csrf_token, set_up_admin):
    response = set_up_admin(client)
    cookie = response.headers["Set-Cookie"]
    assert "HttpOnly" in cookie and "SameSite=Lax" in cookie
    # Plain http on the home LAN: a Secure cookie would be dropped by the browser and login would loop.
    assert "Secure" not in cookie
    client.post("/logout", data={"csrf_token": csrf_token(client, "/")})
    https = "https://localhost"
    # Over HTTPS flask-wtf also wants a same-origin Referer, as browsers send on form posts.
    secure = client.post("/login", base_url=https, headers={"Referer": f"{https}/login"},
                         data={"password": admin_password, "csrf_token": csrf_token(client, base_url=https)})
    assert secure.status_code == 302
    assert "Secure" in secure.headers["Set-Cookie"] and "HttpOnly" in secure.headers["Set-Cookie"]


def test_changing_the_password_ends_other_sessions(app, admin):
    from app.web.auth import set_password

    assert admin.get("/").status_code == 200
    with app.test_request_context():
        set_password("a brand new password")
    assert admin.get("/").status_code == 302


def test_csrf_rejects_forms_and_htmx_without_token(client, csrf_token, set_up_admin):
    set_up_admin(client)
    no_token = client.post("/logout")
    assert no_token.status_code == 400 and "CSRF" in no_token.get_data(as_text=True)
    assert client.get("/").status_code == 200  # still logged in
    header = client.post("/logout", headers={"X-CSRFToken": csrf_token(client, "/")})
    assert header.status_code == 302


def test_api_is_exempt_from_csrf_and_ignores_the_admin_session(admin):
    # The gateway authenticates by bearer token only: the admin cookie opens nothing there.
    response = admin.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
    assert response.status_code == 401
    assert "error" in response.get_json()


def test_login_attempts_are_rate_limited_per_ip(app, client, admin_password, csrf_token, set_up_admin):
    app.config["LOGIN_RATE_LIMIT"] = "3 per minute"
    set_up_admin(client)
    client.post("/logout", data={"csrf_token": csrf_token(client, "/")})
    token = csrf_token(client)
    codes = [client.post("/login", data={"password": "wrong", "csrf_token": token}).status_code for _ in range(3)]
    assert codes == [401, 401, 401]
    limited = client.post("/login", data={"password": admin_password, "csrf_token": token})
    assert limited.status_code == 429
    assert int(limited.headers["Retry-After"]) > 0
    assert "Too Many Requests" in limited.get_data(as_text=True)
    # Another client address has its own budget.
    other = client.post("/login", data={"password": admin_password, "csrf_token": token},
                        environ_overrides={"REMOTE_ADDR": "10.0.0.9"})
    assert other.status_code == 302


def test_error_pages_are_html_for_the_dashboard_and_json_for_apis(admin):
    page = admin.get("/no-such-page")
    assert page.status_code == 404 and page.mimetype == "text/html"
    assert "Back to the overview" in page.get_data(as_text=True)
    api = admin.get("/api/series?metric=nope")
    assert api.status_code == 400 and api.mimetype == "application/json"
    assert "unknown metric nope" in api.get_json()["error"]["message"]


def test_every_dashboard_page_opens_for_the_admin(app, admin):
    for path in dashboard_routes(app):
        response = admin.get(path)
        if path.startswith("/api/"):
            # Chart data needs its query (metric…): a 400 that names what is missing, never a 500.
            assert response.status_code in (200, 400), path
        else:
            # 286: an htmx poll told to stop (nothing running), still a good answer.
            assert response.status_code in (200, 286), path


def test_behind_a_trusted_proxy_https_and_client_ip_come_from_its_headers(tmp_path, default_model_path, admin_password,
                                                                           csrf_token, set_up_admin):
    from app.store.db import open_store
    from app.store.settings import set_setting

    db_engine, sessions = open_store(tmp_path / "data")
    with sessions() as s:
        set_setting(s, "proxy_hops", 1)
        s.commit()
    db_engine.dispose()
    with dashboard_app(tmp_path, default_model_path, LOGIN_RATE_LIMIT="2 per minute") as app:
        client = app.test_client()
        set_up_admin(client)
        client.post("/logout", data={"csrf_token": csrf_token(client, "/")})
        token = csrf_token(client)
        https = {"X-Forwarded-Proto": "https", "X-Forwarded-For": "192.168.1.20", "Referer": "https://localhost/login"}
        # Plain http between proxy and Hearth; the proxy says the browser used https.
        ok = client.post("/login", data={"password": admin_password, "csrf_token": token}, headers=https)
        assert ok.status_code == 302 and "Secure" in ok.headers["Set-Cookie"]
        guesser = app.test_client()
        wrong = {"password": "nope", "csrf_token": csrf_token(guesser)}
        same_ip = {"X-Forwarded-For": "192.168.1.20"}
        assert guesser.post("/login", data=wrong, headers=same_ip).status_code == 401
        assert guesser.post("/login", data=wrong, headers=same_ip).status_code == 429
        # The limit is per client behind the proxy, not per proxy.
        assert guesser.post("/login", data=wrong, headers={"X-Forwarded-For": "192.168.1.21"}).status_code == 401


def session_cookie(client) -> str:
    """The value of the client's session cookie, as a thief who copied it would hold it."""
    return client.get_cookie("hearth_session").value


def replayed(app, cookie: str):
    """A fresh browser that presents a copied session cookie."""
    thief = app.test_client()
    thief.set_cookie("hearth_session", cookie)
    return thief


def test_a_cookie_from_before_logout_is_refused(app, admin, csrf_token):
    copied = session_cookie(admin)
    assert replayed(app, copied).get("/").status_code == 200  # the copy works while the session lives
    admin.post("/logout", data={"csrf_token": csrf_token(admin, "/")})
    thief = replayed(app, copied)
    refused = thief.get("/")
    assert refused.status_code == 302 and refused.headers["Location"].startswith("/login")
    api = thief.get("/api/series?metric=cpu_pct")
    assert api.status_code == 401 and api.get_json()["error"] == "login required"


def test_logging_out_one_browser_leaves_the_others_logged_in(app, admin, admin_password, csrf_token):
    phone = app.test_client()
    assert phone.post("/login", data={"password": admin_password, "csrf_token": csrf_token(phone)}).status_code == 302
    admin.post("/logout", data={"csrf_token": csrf_token(admin, "/")})
    assert admin.get("/").status_code == 302
    assert phone.get("/").status_code == 200
    # Logging in again makes a new session; the one logged out stays dead.
    again = app.test_client()
    assert again.post("/login", data={"password": admin_password, "csrf_token": csrf_token(again)}).status_code == 302
    assert again.get("/").status_code == 200


def test_a_cookie_from_before_a_password_change_is_refused(app, admin, admin_password, csrf_token):
    other = app.test_client()
    other.post("/login", data={"password": admin_password, "csrf_token": csrf_token(other)})
    copied_here, copied_there = session_cookie(admin), session_cookie(other)
    new = "a brand new password"
    changed = admin.post("/settings/password", data={"current": admin_password, "password": new, "confirm": new,
                                                     "csrf_token": csrf_token(admin, "/settings")})
    assert changed.status_code == 302
    assert admin.get("/").status_code == 200  # the browser that changed it stays in, with a new session
    assert other.get("/").status_code == 302
    for cookie in (copied_here, copied_there):
        assert replayed(app, cookie).get("/").status_code == 302


def test_an_unreadable_session_list_logs_everyone_out_and_login_mends_it(app, admin, admin_password, csrf_token):
    data = services(app).data_dir
    (data / "secrets" / "admin_sessions").write_text("{not json")
    assert admin.get("/").status_code == 302
    assert admin.post("/login", data={"password": admin_password, "csrf_token": csrf_token(admin)}).status_code == 302
    assert admin.get("/").status_code == 200
    assert stat.S_IMODE((data / "secrets" / "admin_sessions").stat().st_mode) == 0o600
