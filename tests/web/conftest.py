"""The dashboard app on a fresh data folder per test (no scheduler, no runner), and logged-in clients.

Reusable by every dashboard page's tests (as fixtures, no imports): `app`, `client` (anonymous),
`admin` (logged in), `csrf_token` (the function csrf_token(client, path="/login"): a valid token
for that client's session), `set_up_admin` (the function that does the first-run setup on a client),
`admin_password`.
"""

import re

import pytest

from app.factory import create_app, shutdown_app

ADMIN_PASSWORD = "correct horse battery"
# A form's hidden field, or the htmx header every page carries on <body>.
_TOKEN = re.compile(r'name="csrf_token" value="([^"]+)"|"X-CSRFToken": "([^"]+)"')


@pytest.fixture
def app(tmp_path, gemma_path):
    """create_app on a temporary HEARTH_DATA; the embedded model is the shared Gemma file (nothing assembled)."""
    app = create_app({"HEARTH_DATA": str(tmp_path / "data"), "HEARTH_MODELS_DIR": str(tmp_path / "models"),
                      "HEARTH_DEFAULT_MODEL": str(gemma_path), "SCHEDULER": False, "TESTING": True})
    yield app
    shutdown_app(app)


@pytest.fixture
def client(app):
    """An anonymous browser."""
    return app.test_client()


def csrf_token(client, path: str = "/login", **get_options) -> str:
    """A CSRF token bound to this client's session, read from a page (redirects followed)."""
    page = client.get(path, follow_redirects=True, **get_options)
    match = _TOKEN.search(page.get_data(as_text=True))
    assert match, f"no csrf_token on {path} ({page.status_code})"
    return match.group(1) or match.group(2)


def set_up_admin(client, password: str = ADMIN_PASSWORD):
    """First run: create the admin password through /setup (which also logs this client in)."""
    response = client.post("/setup", data={"password": password, "confirm": password,
                                           "csrf_token": csrf_token(client, "/setup")})
    assert response.status_code == 302, response.get_data(as_text=True)
    return response


@pytest.fixture
def admin(app):
    """A client logged in as the admin (the password was created through /setup)."""
    c = app.test_client()
    set_up_admin(c)
    return c


@pytest.fixture(name="csrf_token")
def csrf_token_fixture():
    """The csrf_token helper, as a fixture for tests in other modules."""
    return csrf_token


@pytest.fixture(name="set_up_admin")
def set_up_admin_fixture():
    """The set_up_admin helper, as a fixture."""
    return set_up_admin


@pytest.fixture
def admin_password():
    """The password `admin` and set_up_admin use."""
    return ADMIN_PASSWORD
