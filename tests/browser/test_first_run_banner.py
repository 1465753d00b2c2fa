"""First run in a real browser: /setup shows the default model's progress bar, which polls itself
until the model is ready, then says so and stops polling (HTTP 286)."""

import threading
from pathlib import Path

import pytest
from werkzeug.serving import make_server

from app.factory import create_app, shutdown_app
from app.residency import default_model
from app.residency.supervisor import free_port
from tests.browser.conftest import _watch, shot


@pytest.fixture
def first_run(tmp_path, standin_model, monkeypatch):
    """An in-process server on a fresh data folder whose default model is held at 42 % until released."""
    release = threading.Event()

    def blocked_ensure(data_dir, progress=True, on_progress=None):
        on_progress("assembling", 42, 100)
        assert release.wait(60), "the test never released the assembly"
        return Path(standin_model)

    monkeypatch.delenv("HEARTH_DEFAULT_MODEL", raising=False)
    monkeypatch.setattr(default_model, "ensure_default_model", blocked_ensure)
    app = create_app({"HEARTH_DATA": str(tmp_path / "data"), "HEARTH_MODELS_DIR": str(tmp_path / "models"),
                      "HEARTH_DEFAULT_MODEL": None, "SCHEDULER": False})
    server = make_server("127.0.0.1", free_port(), app, threaded=True)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}", release
    release.set()
    server.shutdown()
    shutdown_app(app)


def test_setup_shows_the_bar_until_the_model_is_ready(browser, first_run):
    url, release = first_run
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    page = context.new_page()
    errors = _watch(page)
    polls = []
    page.on("response", lambda r: polls.append(r.status) if "/partials/default-model" in r.url else None)
    page.goto(url + "/setup")
    bar = page.locator("#default-model-progress progress")
    assert bar.get_attribute("value") == "42" and bar.get_attribute("max") == "100"
    # It polls itself while assembling (every second).
    with page.expect_response(lambda r: "/partials/default-model" in r.url and r.status == 200, timeout=10_000):
        pass
    shot(page, "setup-default-model-progress")
    release.set()
    page.wait_for_selector("#default-model-progress:has-text('The default model is ready')", timeout=30_000)
    assert page.locator("#default-model-progress").get_attribute("hx-trigger") is None
    assert polls[-1] == 286
    seen = len(polls)
    page.wait_for_timeout(1500)  # one and a half poll intervals: absence has no event to wait on
    assert len(polls) == seen  # polling stopped
    assert page.locator("input[name=password]").is_visible()  # the admin's form was left alone
    context.close()
    assert not errors, errors
