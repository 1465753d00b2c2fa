"""The runner's WSGI app before a model is there: loading and failed states, key, CORS, error shapes (no llama.cpp needed)."""

from werkzeug.test import Client

from app.engine.model_config import ModelConfig
from app.runner.app import create_app
from app.runner.config import RunnerConfig


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


def keyed_client(**config) -> Client:
    app = create_app(RunnerConfig(ModelConfig(path="/nowhere/model.gguf"), **config), load=False)
    app.state.status = "loading"
    return Client(app)


def test_api_key_is_asked_everywhere_but_health():
    c = keyed_client(api_keys=("sk-one", "sk-two"))
    assert c.get("/health").status_code == 503  # public: still loading, but no key asked
    r = c.post("/completion", json={"prompt": "hi"})
    assert r.status_code == 401 and r.json["error"]["type"] == "authentication_error"
    assert c.post("/completion", json={"prompt": "hi"}, headers={"Authorization": "Bearer sk-nope"}).status_code == 401
    # A good key (bearer, or Anthropic's X-Api-Key header) passes on to the endpoint, which says it is loading.
    assert c.post("/completion", json={"prompt": "hi"}, headers={"Authorization": "Bearer sk-two"}).status_code == 503
    assert c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]},
                  headers={"X-Api-Key": "sk-one"}).status_code == 503


def test_cors_preflight_answers_without_a_key_and_echoes_the_origin():
    c = keyed_client(api_keys=("sk-one",))
    r = c.options("/v1/chat/completions", headers={"Origin": "http://app.example", "Access-Control-Request-Method": "POST"})
    assert r.status_code == 200
    assert r.headers["Access-Control-Allow-Origin"] == "http://app.example"
    assert r.headers["Access-Control-Allow-Credentials"] == "true"
    assert "POST" in r.headers["Access-Control-Allow-Methods"]


def test_cors_localhost_reflects_only_loopback_origins():
    c = keyed_client(cors_origins="localhost")
    ok = c.options("/completions", headers={"Origin": "http://127.0.0.1:3000"})
    assert ok.headers["Access-Control-Allow-Origin"] == "http://127.0.0.1:3000"
    for evil in ("http://localhost.evil.com", "http://evil.com", "http://notlocalhost"):
        assert "Access-Control-Allow-Origin" not in c.options("/completions", headers={"Origin": evil}).headers


def test_unknown_path_is_llama_servers_json_404():
    r = keyed_client().get("/no/such/thing")
    assert r.status_code == 404
    assert r.json == {"error": {"message": "File Not Found", "type": "not_found_error", "code": 404}}
    wrong_method = keyed_client().get("/completion")  # a POST route asked with GET
    assert wrong_method.status_code == 405 and wrong_method.json["error"]["message"]


def test_endpoints_switched_off_answer_501():
    c = keyed_client(metrics=False, slots=False)
    for path in ("/metrics", "/slots"):
        r = c.get(path)
        assert r.status_code == 501 and r.json["error"]["type"] == "not_supported_error"


def test_pooling_none_has_no_embeddings_answer_and_says_which_pooling_to_start_with():
    c = keyed_client(embedding=True, pooling="none")
    r = c.post("/v1/embeddings", json={"input": "hello hello hello"})
    assert r.status_code == 400 and r.json["error"]["code"] == "pooling_not_supported"
    assert "--pooling mean" in r.json["error"]["message"]


def test_errors_on_messages_take_anthropics_shape():
    c = make_client("loading")
    r = c.post("/v1/messages", json={"max_tokens": 5})
    assert r.status_code == 400
    assert r.json == {"type": "error", "error": {"type": "invalid_request_error", "message": "'messages' is required"}}
    r = c.post("/v1/messages", data=b"{not json", content_type="application/json")
    assert r.status_code == 400 and r.json["error"]["type"] == "invalid_request_error"
    # While the model loads the chat route's 503 comes back in Anthropic's words.
    r = c.post("/v1/messages", json={"messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 503 and r.json["error"]["type"] == "overloaded_error"
    assert r.headers["Retry-After"] == "1"
    assert c.post("/v1/messages/count_tokens", json={"messages": []}).status_code == 503


def test_errors_on_responses_keep_openais_shape():
    c = make_client("loading")
    r = c.post("/v1/responses", json={"input": "hi", "previous_response_id": "resp_x"})
    assert r.status_code == 400 and r.json["error"]["param"] == "previous_response_id"
    r = c.post("/responses", json={"input": "hi"})
    assert r.status_code == 503 and r.headers["Retry-After"] == "1"
