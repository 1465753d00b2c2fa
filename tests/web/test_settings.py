"""Settings page: every registered setting editable with validation; env-provided values read-only;
the admin password change."""

import pytest

from app.gateway.context import services
from app.store.settings import REGISTRY, get_setting


def stored(app, name):
    with services(app).sessions() as s:
        return get_setting(s, name)


@pytest.fixture
def post(csrf_token):
    """POST a form as the given client, with a valid CSRF token."""

    def send(client, data, path="/settings"):
        return client.post(path, data={**data, "csrf_token": csrf_token(client, "/settings")})

    return send


def test_page_lists_every_setting(admin):
    html = admin.get("/settings").get_data(as_text=True)
    for name in REGISTRY:
        assert f'id="setting-{name}"' in html, name
    assert "restart to apply" in html and "Admin password" in html


def test_saving_valid_values(app, admin, tmp_path, post):
    folder = tmp_path / "more-models"
    folder.mkdir()
    response = post(admin, {"samples_retention_h": "72", "memory_reserve_mb": "1024", "status_public": "on",
                            "models_dir": str(folder), "bind": "0.0.0.0:8081"})
    assert response.status_code == 302
    assert stored(app, "samples_retention_h") == 72.0
    assert stored(app, "memory_reserve_mb") == 1024
    assert stored(app, "status_public") is True
    assert stored(app, "models_dir") == str(folder)
    assert stored(app, "bind") == "0.0.0.0:8081"
    flashed = admin.get("/settings").get_data(as_text=True)
    assert "Restart hearth serve for bind, models_dir" in flashed
    # An empty field goes back to the default; an unticked box is off.
    post(admin, {"memory_reserve_mb": "", "samples_retention_h": "72"})
    assert stored(app, "memory_reserve_mb") is None
    assert stored(app, "status_public") is False


@pytest.mark.parametrize(("name", "value", "message"), [
    ("samples_retention_h", "lots", "Enter a number."),
    ("runner_parallel", "0", "Use at least 1 slots."),
    ("runner_parallel", "2.5", "Enter a whole number."),
    ("memory_limit_mb", "100", "Use at least 256 MiB."),
    ("verdict_rare_overlap_share", "1.5", "Use at most 1."),
    ("bind", "everywhere", "Use host:port"),
    ("bind", "0.0.0.0:99999", "Use host:port"),
    ("models_dir", "relative/path", "absolute path"),
    ("models_dir", "/no/such/folder", "is not a folder"),
    ("default_model", "gpt-17", "Unknown model"),
])
def test_invalid_values_are_refused_with_a_reason(app, admin, name, value, message, post):
    before = stored(app, name)
    response = post(admin, {name: value, "rescan_interval_s": "30"})
    assert response.status_code == 400
    html = response.get_data(as_text=True)
    assert message in html and "Nothing was saved" in html
    assert f'value="{value}"' in html  # what the admin typed stays in the field
    assert stored(app, name) == before
    assert stored(app, "rescan_interval_s") == 60  # nothing saved when any field is wrong


def test_default_model_accepts_a_catalog_name(app, admin, post):
    name = next(iter(services(app).catalog.model_specs()))
    assert post(admin, {"default_model": name}).status_code == 302
    assert stored(app, "default_model") == name


def test_env_provided_values_are_shown_and_not_editable(app, admin, monkeypatch, post):
    monkeypatch.setenv("HEARTH_BIND", "0.0.0.0:9999")
    html = admin.get("/settings").get_data(as_text=True)
    assert "from $HEARTH_BIND" in html and 'value="0.0.0.0:9999" disabled' in html
    post(admin, {"bind": "127.0.0.1:7000"})
    assert stored(app, "bind") is None


def test_settings_need_login_and_csrf(app, admin, client):
    assert client.get("/settings").status_code == 302
    assert admin.post("/settings", data={"status_public": "on"}).status_code == 400
    assert stored(app, "status_public") is False


def test_change_password(app, admin, post, csrf_token, admin_password):
    wrong = post(admin, {"current": "nope", "password": "new password 1", "confirm": "new password 1"},
                 "/settings/password")
    assert wrong.status_code == 400 and "current password is wrong" in wrong.get_data(as_text=True)
    other = app.test_client()
    other.post("/login", data={"password": admin_password, "csrf_token": csrf_token(other)})
    assert other.get("/settings").status_code == 200
    ok = post(admin, {"current": admin_password, "password": "new password 1", "confirm": "new password 1"},
              "/settings/password")
    assert ok.status_code == 302
    assert admin.get("/settings").status_code == 200  # this session continues
    assert other.get("/settings").status_code == 302  # the other one is logged out
