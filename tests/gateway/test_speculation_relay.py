"""Speculative decoding through the gateway, against a loopback stand-in runner: a class switched off sends the
runner llama-server's "speculative.n_max": 0, and the runner's final timings (draft_n, draft_n_accepted) reach
the request log, whole and streamed."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from app.admin import update_class
from app.gateway import relay
from app.gateway.context import services
from app.gateway.pipeline import NO_DRAFTS_FIELD
from app.gateway.tokens import create_token
from tests.helpers import dashboard_app, query, wait_until

TIMINGS = {"prompt_n": 5, "predicted_n": 9, "draft_n": 12, "draft_n_accepted": 7}
USAGE = {"prompt_tokens": 5, "completion_tokens": 9, "total_tokens": 14}
ANSWER = {"id": "c", "object": "chat.completion", "created": 0, "model": "standin",
          "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hi"}, "finish_reason": "stop"}],
          "usage": USAGE, "timings": TIMINGS}
STREAM = [
    {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
    {"choices": [{"index": 0, "delta": {"content": "Hi"}}]},
    # The hearth runner's finishing chunk: usage and timings together (llama-server's include_usage shape).
    {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}], "usage": USAGE, "timings": TIMINGS},
]


class StandIn(BaseHTTPRequestHandler):
    """A runner that keeps every body it is sent and answers with drafted timings, whole or streamed."""

    protocol_version = "HTTP/1.1"
    bodies: list = []

    def log_message(self, *args):
        pass

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        StandIn.bodies.append(body)
        if body.get("stream"):
            payload = b"".join(b"data: " + json.dumps(ev).encode() + b"\n\n" for ev in STREAM) + b"data: [DONE]\n\n"
            kind = "text/event-stream"
        else:
            payload, kind = json.dumps(ANSWER).encode(), "application/json"
        self.send_response(200)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)


class Lease:
    """A lease on the stand-in (what the residency manager hands the gateway)."""

    def __init__(self, url: str):
        self.url, self.node_label, self.model_name = url, "standin", "standin"

    def release(self):
        pass


@pytest.fixture
def standin():
    server = ThreadingHTTPServer(("127.0.0.1", 0), StandIn)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    StandIn.bodies = []
    yield f"http://127.0.0.1:{server.server_address[1]}"
    relay.close_idle()
    server.shutdown()
    server.server_close()


@pytest.fixture
def gateway(standin, tmp_path, standin_model):
    """(app, bearer headers of a chat token allowed voice, the request log's path) with every lease on the stand-in."""
    with dashboard_app(tmp_path, standin_model) as app:
        svc = services(app)
        with svc.sessions() as s:
            token, _ = create_token(s, "alice", "chat", ["voice"])
            s.commit()
        svc.router.acquire = lambda name: Lease(standin)
        yield app, {"Authorization": f"Bearer {token}"}, tmp_path / "data" / "hearth.db"


def _switch(app, name: str, on: bool) -> None:
    svc = services(app)
    with svc.sessions() as s:
        update_class(s, name, {"speculation": "on" if on else "off"})
        s.commit()
    svc.classes.invalidate()


CHAT = {"messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", CHAT),
    ("/v1/completions", {"prompt": "Once upon a time"}),
    ("/api/chat", {**CHAT, "stream": False}),  # Ollama's API: through its adapter, the same body goes out
])
def test_a_class_switched_off_asks_the_runner_for_no_drafts(gateway, path, body):
    app, auth, _ = gateway
    client = app.test_client()
    body = {**body, "model": services(app).catalog.default_model_name()}
    assert client.post(path, headers=auth, json=body).status_code == 200
    # Left on (every class by default), the runner decides by load: the gateway adds nothing.
    assert NO_DRAFTS_FIELD not in StandIn.bodies[-1]
    _switch(app, "chat", on=False)
    assert client.post(path, headers=auth, json=body).status_code == 200
    assert StandIn.bodies[-1][NO_DRAFTS_FIELD] == 0
    # Another class of the same token is not touched.
    assert client.post(path, headers={**auth, "X-Hearth-Class": "voice"}, json=body).status_code == 200
    assert NO_DRAFTS_FIELD not in StandIn.bodies[-1]


def test_a_class_switched_off_overrides_what_the_client_asked(gateway):
    app, auth, _ = gateway
    _switch(app, "chat", on=False)
    r = app.test_client().post("/v1/chat/completions", headers=auth, json={**CHAT, NO_DRAFTS_FIELD: 16})
    assert r.status_code == 200 and StandIn.bodies[-1][NO_DRAFTS_FIELD] == 0


@pytest.mark.parametrize("stream", [False, True])
def test_the_runners_draft_counts_reach_the_request_log(gateway, stream):
    app, auth, db_path = gateway
    r = app.test_client().post("/v1/chat/completions", headers=auth, json={**CHAT, "stream": stream})
    assert r.status_code == 200
    r.get_data()  # a stream's row is written once its body has been read to the end
    rows = wait_until(lambda: query(db_path, "select stream, completion_tokens, draft_tokens, draft_accepted "
                                             "from requests"), message="the request's row")
    assert rows == [(int(stream), 9, 12, 7)]


def test_a_request_that_did_not_draft_logs_no_draft_counts(gateway, monkeypatch):
    app, auth, db_path = gateway
    monkeypatch.setitem(ANSWER, "timings", {"prompt_n": 5, "predicted_n": 9})
    assert app.test_client().post("/v1/chat/completions", headers=auth, json=CHAT).status_code == 200
    rows = wait_until(lambda: query(db_path, "select draft_tokens, draft_accepted from requests"),
                      message="the request's row")
    assert rows == [(None, None)]


def test_serve_metrics_count_draft_tokens_by_class(gateway):
    app, auth, db_path = gateway
    svc = services(app)
    assert app.test_client().post("/v1/chat/completions", headers=auth, json=CHAT).status_code == 200
    wait_until(lambda: query(db_path, "select id from requests"), message="the request's row")
    text = svc.metrics.render().decode()
    assert 'hearth:gateway_draft_tokens_total{class="chat"} 12.0' in text
    assert 'hearth:gateway_draft_accepted_tokens_total{class="chat"} 7.0' in text
