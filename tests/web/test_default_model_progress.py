"""First run: the server answers while the default model is assembled in the background."""

import threading
from pathlib import Path

import pytest

from app.factory import create_app, shutdown_app
from app.gateway.context import services
from app.gateway.tokens import create_token
from app.residency import default_model


@pytest.fixture
def assembling(tmp_path, standin_model, monkeypatch):
    """create_app on a fresh data folder whose default model is held at 42 % until `release` is set."""
    release = threading.Event()

    def blocked_ensure(data_dir, progress=True, on_progress=None):
        on_progress("assembling", 42, 100)
        assert release.wait(30), "the test never released the assembly"
        on_progress("verifying", 100, 100)
        return Path(standin_model)

    monkeypatch.delenv("HEARTH_DEFAULT_MODEL", raising=False)
    monkeypatch.setattr(default_model, "ensure_default_model", blocked_ensure)
    app = create_app({"HEARTH_DATA": str(tmp_path / "data"), "HEARTH_MODELS_DIR": str(tmp_path / "models"),
                      "HEARTH_DEFAULT_MODEL": None, "SCHEDULER": False, "TESTING": True})
    hearth = services(app)
    with hearth.sessions() as s:
        token, _ = create_token(s, "alice", "chat")
        s.commit()
    yield app, release, {"Authorization": f"Bearer {token}"}
    release.set()
    shutdown_app(app)


def test_default_model_assembles_while_the_server_answers(assembling, set_up_admin):
    app, release, auth = assembling
    hearth = services(app)
    client = app.test_client()
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}

    for model in (None, "default", "gemma-3-270m-q4_k_m"):
        r = client.post("/v1/chat/completions", headers=auth, json={**chat, "model": model} if model else chat)
        assert r.status_code == 503 and r.headers["Retry-After"] == "5"
        error = r.get_json()["error"]
        assert error["code"] == "default_model_assembling" and error["type"] == "unavailable_error"
        assert error["message"] == "the default model is being assembled (42 %); retry in a few seconds"
    # Other models are resolved as usual.
    r = client.post("/v1/chat/completions", headers=auth, json={**chat, "model": "other"})
    assert r.status_code == 404 and r.get_json()["error"]["code"] == "model_not_found"

    health = client.get("/healthz")
    assert health.status_code == 200
    assert health.get_json() == {"status": "ok",
                                 "default_model": {"state": "assembling", "percent": 42, "error": None}}

    # No admin yet: the first-run page and the banner's own endpoint show the bar without a login.
    setup = client.get("/setup").get_data(as_text=True)
    assert 'id="default-model-progress"' in setup and '<progress max="100" value="42">' in setup
    partial = client.get("/partials/default-model")
    assert partial.status_code == 200
    html = partial.get_data(as_text=True)
    assert '<progress max="100" value="42">' in html and 'hx-trigger="every 1s"' in html
    assert client.get("/v1/models", headers=auth).get_json()["data"] == []
    admin = app.test_client()
    set_up_admin(admin)
    for page in ("/", "/models", "/status"):
        r = admin.get(page)
        assert r.status_code == 200 and '<progress max="100" value="42">' in r.get_data(as_text=True), page

    release.set()
    hearth.catalog.default_model_assembly.join(30)
    done = client.get("/partials/default-model")
    assert done.status_code == 286
    assert "The default model is ready" in done.get_data(as_text=True) and "<progress" not in done.get_data(as_text=True)
    assert client.get("/healthz").get_json() == {"status": "ok"}
    assert [m["id"] for m in client.get("/v1/models", headers=auth).get_json()["data"]] == ["gemma-3-270m-q4_k_m"]
    assert "default-model-progress" not in client.get("/setup").get_data(as_text=True)


def test_a_failed_assembly_is_shown_and_stops_polling(tmp_path, monkeypatch):
    monkeypatch.delenv("HEARTH_DEFAULT_MODEL", raising=False)
    monkeypatch.setattr(default_model, "chunk_paths", lambda: [tmp_path / "gone.part00"])
    app = create_app({"HEARTH_DATA": str(tmp_path / "data"), "HEARTH_MODELS_DIR": str(tmp_path / "models"),
                      "HEARTH_DEFAULT_MODEL": None, "SCHEDULER": False, "TESTING": True})
    try:
        services(app).catalog.default_model_assembly.join(30)
        client = app.test_client()
        r = client.get("/partials/default-model")
        assert r.status_code == 286 and "could not be assembled" in r.get_data(as_text=True)
        assert "reinstall" in r.get_data(as_text=True)
        assert client.get("/healthz").get_json()["default_model"]["state"] == "failed"
    finally:
        shutdown_app(app)


def test_a_given_default_model_is_used_at_once(app):
    hearth = services(app)
    assert hearth.catalog.default_model_assembly is None and hearth.catalog.default_model_progress() is None
    assert app.test_client().get("/partials/default-model").status_code == 286
