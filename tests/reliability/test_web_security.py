"""Dashboard security across every mutation, and telemetry losses shown on the overview.

tests/web/test_auth.py checks the login flow itself (cookie flags, rate limit, CSRF on a form);
this suite walks the app's URL map so a mutation added later cannot skip the admin session or CSRF.
"""

from __future__ import annotations

import re
import sqlite3

import pytest

from app.gateway.context import services
from tests.helpers import ADMIN_PASSWORD, csrf_token, dashboard_app, set_up_admin

# Public on purpose: the OpenAI API (bearer tokens) and the forms that create or open a session.
NOT_ADMIN_MUTATIONS = {"gateway.chat_completions", "gateway.completions", "gateway.embeddings", "gateway.infill", "auth.setup",
                       "auth.login"}
# The Ollama API authenticates by bearer token (its model changes also need api_manage_models); so do
# the other vendors' APIs (Anthropic's Messages, OpenAI's Responses) and the transcription upload.
TOKEN_BLUEPRINTS = ("ollama.", "vendors.", "audio.")


@pytest.fixture
def app(tmp_path, standin_model):
    """The app on a fresh data folder, no scheduler and no runner."""
    with dashboard_app(tmp_path, standin_model) as app:
        yield app


@pytest.fixture
def admin(app):
    """A client logged in through first-run setup."""
    c = app.test_client()
    set_up_admin(c)
    return c


def mutations(app) -> list[tuple[str, str]]:
    """(endpoint, concrete URL) of every state-changing route of the dashboard."""
    out = []
    for rule in app.url_map.iter_rules():
        if not rule.methods & {"POST", "PUT", "PATCH", "DELETE"} or rule.endpoint in NOT_ADMIN_MUTATIONS \
                or rule.endpoint.startswith(TOKEN_BLUEPRINTS):
            continue
        values = {arg: 1 if type(rule._converters.get(arg)).__name__ == "IntegerConverter" else "chat"
                  for arg in rule.arguments}
        out.append((rule.endpoint, rule.rule if not values else _build(rule.rule, values)))
    return out


def _build(rule: str, values: dict) -> str:
    return re.sub(r"<(?:[^:>]+:)?([^>]+)>", lambda m: str(values[m.group(1)]), rule)


def test_every_dashboard_mutation_needs_the_admin_session_and_a_csrf_token(app, admin):
    found = mutations(app)
    assert {"auth.logout", "members.create", "models.unload", "settings.save", "classes.save"} <= {e for e, _ in found}
    with sqlite3.connect(services(app).data_dir / "hearth.db") as db:
        before = db.execute("select count(*) from api_tokens").fetchone()
    anonymous = app.test_client()
    token = csrf_token(admin, "/")
    for endpoint, url in found:
        # No session (even with a CSRF token of another session): refused before the view runs.
        r = anonymous.post(url, data={"csrf_token": token, "member": "mallory", "default_class": "chat"})
        assert r.status_code in (302, 400, 401), (endpoint, r.status_code)
        assert r.status_code != 302 or "/login" in r.headers["Location"], (endpoint, r.headers.get("Location"))
        # The admin's own session, without the token: a forged cross-site form.
        r = admin.post(url, data={"member": "mallory", "default_class": "chat"})
        assert r.status_code == 400, (endpoint, r.status_code)
        assert "CSRF" in r.get_data(as_text=True), endpoint
    with sqlite3.connect(services(app).data_dir / "hearth.db") as db:
        assert db.execute("select count(*) from api_tokens").fetchone() == before


def test_an_api_token_never_opens_the_dashboard(app, admin):
    with app.app_context():
        from app.gateway.tokens import create_token

        with services(app).sessions() as s:
            token, _ = create_token(s, "alice", "chat")
    c = app.test_client()
    r = c.get("/", headers={"Authorization": f"Bearer {token}"})
    assert r.status_code == 302 and "/login" in r.headers["Location"]
    r = c.post("/members/tokens", headers={"Authorization": f"Bearer {token}"}, data={"member": "x"})
    assert r.status_code in (302, 400, 401)


def test_session_cookie_is_httponly_and_samesite(app):
    r = set_up_admin(app.test_client())
    cookie = next(h for h in r.headers.getlist("Set-Cookie") if h.startswith("hearth_session="))
    assert "HttpOnly" in cookie and re.search(r"SameSite=(Lax|Strict)", cookie)


def test_pages_show_no_secret(app, admin):
    data = services(app).data_dir
    secrets = [p.read_text().strip() for p in (data / "secrets").glob("*")]
    assert secrets  # the session key and the admin password hash exist by now
    for path in ("/", "/settings", "/members", "/models", "/status", "/classes", "/requests"):
        page = admin.get(path, follow_redirects=True).get_data(as_text=True)
        assert all(s not in page for s in secrets), path
        assert ADMIN_PASSWORD not in page


def test_telemetry_losses_are_shown_on_the_overview(app, admin):
    hearth = services(app)
    assert "telemetry-health" not in admin.get("/").get_data(as_text=True)
    writer = hearth.writer
    # What a full disk leaves behind (the writer's own bookkeeping; test_telemetry_loss.py makes it
    # happen for real).
    with writer._lock:
        writer._count_lost("disk_full", 42)
        writer._last_error, writer._failing_since = "database or disk is full", 1.0
    page = admin.get("/").get_data(as_text=True)
    assert 'id="telemetry-health"' in page
    assert "not being saved" in page and "disk full 42" in page and "database or disk is full" in page
    writer._failing_since = None
    page = admin.get("/").get_data(as_text=True)
    assert "Some telemetry was lost" in page and "Rows lost since start: 42" in page


def test_a_runner_crash_is_shown_on_the_models_page(app, admin):
    from app.residency.manager import ResidencyEvent
    from app.services.records import record_residency_event

    writer = services(app).writer
    # What the residency manager's on_event does when a runner dies.
    record_residency_event(writer, ResidencyEvent("gemma-3-270m-q4_k_m", "crash", "runner exited with -9 (SIGKILL)",
                                                  node="local", pid=4242))
    assert writer.flush(10)
    page = admin.get("/models").get_data(as_text=True)
    assert "crash" in page and "SIGKILL" in page


def test_no_page_may_be_framed_by_another_site(app, admin):
    from tests.web.test_auth import dashboard_routes

    paths = dashboard_routes(app) + ["/login", "/setup", "/healthz", "/metrics", "/v1/models", "/no-such-page"]
    for path in paths:
        for client in (admin, app.test_client()):
            response = client.get(path)
            assert response.headers.get("Content-Security-Policy") == "frame-ancestors 'none'", path
            assert response.headers.get("X-Frame-Options") == "DENY", path
            assert response.headers.get("X-Content-Type-Options") == "nosniff", path
