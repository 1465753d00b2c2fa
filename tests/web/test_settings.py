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


def test_page_lists_every_setting_with_its_section_unit_bounds_and_restart(admin):
    html = admin.get("/settings").get_data(as_text=True)
    for name, d in REGISTRY.items():
        assert f'id="setting-{name}"' in html, name
        assert f"<h2>{d.section}</h2>" in html, d.section
    assert "Admin password" in html
    ctx = section_of(html, "runner_ctx")
    assert "Allowed: 256 to 1048576 cells." in ctx and '<span class="muted small">cells</span>' in ctx
    assert "needs a restart" not in ctx
    assert "needs a restart" in section_of(html, "max_in_flight_total")
    # Choices known only at run time are offered, not typed: the models this serve has, the classes.
    assert "<option value=\"voice\">voice</option>" in section_of(html, "api_open_class")


def section_of(html, name):
    """The markup of one setting's row."""
    start = html.index(f'id="setting-{name}"')
    end = html.find('id="setting-', start + 1)
    return html[start:end if end > 0 else len(html)]


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
    ("samples_retention_h", "lots", "samples_retention_h must be a number (got lots)"),
    ("runner_ctx", "8", "runner_ctx must be at least 256 (got 8)"),
    ("max_in_flight_total", "abc", "max_in_flight_total must be a whole number (got abc)"),
    ("runner_parallel", "0", "runner_parallel must be at least 1 (got 0)"),
    ("runner_parallel", "2.5", "must be a whole number"),
    ("memory_limit_mb", "100", "memory_limit_mb must be at least 256 (got 100)"),
    ("verdict_rare_overlap_share", "1.5", "verdict_rare_overlap_share must be at most 1 (got 1.5)"),
    ("bind", "everywhere", "must be host:port"),
    ("bind", "0.0.0.0:99999", "must be host:port"),
    ("models_dir", "relative/path", "absolute path"),
    ("models_dir", "/no/such/folder", "is not one"),
    ("default_model", "gpt-17", "default_model must be one of: "),
    ("api_open_class", "poetry", "api_open_class must be one of: background, chat, coding, documents, voice (got poetry)"),
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


def test_a_batch_smaller_than_the_slots_is_refused_on_both_fields_together(app, admin, post):
    response = post(admin, {"runner_parallel": "64", "runner_batch": "32"})
    assert response.status_code == 400
    assert "runner_batch must be at least runner_parallel (64)" in response.get_data(as_text=True)
    assert stored(app, "runner_parallel") is None and stored(app, "runner_batch") == 512  # None: sized
    assert post(admin, {"runner_parallel": "64", "runner_batch": "64"}).status_code == 302
    assert (stored(app, "runner_parallel"), stored(app, "runner_batch")) == (64, 64)


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
