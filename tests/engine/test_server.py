"""The runner's WSGI app before a model is there: loading and failed states (no llama.cpp needed)."""

from werkzeug.test import Client

from app.engine.model_config import ModelConfig
from app.engine.server import RunnerConfig, create_app


def make_client(status: str, error: str | None = None) -> Client:
    app = create_app(RunnerConfig(ModelConfig(path="/nowhere/model.gguf")), load=False)
    app.state.status = status
    app.state.error = error
    return Client(app)


def test_health_is_503_while_loading_and_requests_are_told_to_retry():
    c = make_client("loading")
    h = c.get("/health")
    assert h.status_code == 503 and h.json["status"] == "loading"
    r = c.post("/v1/completions", json={"prompt": "hi"})
    assert r.status_code == 503
    assert r.headers["Retry-After"] == "1"
    assert r.json["error"]["code"] == "loading"


def test_bad_input_is_rejected_before_the_model_is_needed():
    c = make_client("loading")
    r = c.post("/v1/chat/completions", json={"messages": "hi"})
    assert r.status_code == 400
    assert r.json["error"]["param"] == "messages"


def test_failed_load_is_reported_with_its_reason():
    c = make_client("error", "llama.cpp could not load /nowhere/model.gguf")
    h = c.get("/health")
    assert h.status_code == 500 and "could not load" in h.json["error"]["message"]
    r = c.post("/v1/completions", json={"prompt": "hi"})
    assert r.status_code == 500
    assert "failed to load" in r.json["error"]["message"]
