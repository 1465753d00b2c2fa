"""The dashboard app on a fresh data folder per test (no scheduler, no runner), and logged-in clients.

Reusable by every dashboard page's tests (as fixtures, no imports): `app`, `client` (anonymous),
`admin` (logged in), `csrf_token` (the function csrf_token(client, path="/login"): a valid token
for that client's session), `set_up_admin` (the function that does the first-run setup on a client),
`admin_password`. The embedded model is `default_model_path`: the stand-in GGUF (a catalog entry,
nothing to load); a test that loads it overrides `default_model_path` with `gemma_path` (and so
becomes a `model` test).
"""

import pytest

from tests.helpers import ADMIN_PASSWORD, csrf_token, dashboard_app, set_up_admin


@pytest.fixture
def default_model_path(standin_model):
    """The file the app takes as its embedded model."""
    return standin_model


@pytest.fixture
def app(tmp_path, default_model_path):
    """create_app on a temporary HEARTH_DATA; the embedded model is `default_model_path` (nothing assembled)."""
    with dashboard_app(tmp_path, default_model_path) as app:
        yield app


@pytest.fixture
def client(app):
    """An anonymous browser."""
    return app.test_client()


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
