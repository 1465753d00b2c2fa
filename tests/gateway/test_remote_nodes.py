"""Remote nodes through a real `hearth serve`: an https:// node relayed over verified TLS, a node's 503
(loading or full) passed on without marking it down, and a model whose file name is not Latin-1.

The node is a stub OpenAI server on loopback (`NodeStub`), so no model is loaded anywhere: the memory
budget is set below the model's estimate, which leaves the remote node as the only place to serve it.
"""

from __future__ import annotations

import json
import shutil
import ssl
import subprocess
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote

import httpx
import pytest

from app.residency.remote import NODE_CA_ENV, RemoteNode
from app.store.db import open_store
from app.store.models import Model, Node, utcnow
from tests.helpers import SMALL_RUNNERS, ServeStarter, wait_until

# The budget's lowest allowed value, under the stand-in's estimate at this context: no local runner fits.
TIGHT = {**SMALL_RUNNERS, "memory_limit_mb": 256, "runner_ctx": 32768}
ANSWER = {"id": "chatcmpl-stub", "object": "chat.completion", "created": 0, "model": "stub",
          "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi from the node"},
                       "finish_reason": "stop"}],
          "usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}}


class NodeStub:
    """An OpenAI-compatible server on loopback: /health answers `health`, chat answers `chat` (status)."""

    def __init__(self, tls: ssl.SSLContext | None = None):
        self.health = 200
        self.chat = 200
        self.chat_posts = 0
        self.health_gets = 0
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _answer(self, status: int, body: dict, headers: dict | None = None):
                payload = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(payload)

            def do_GET(self):
                if self.path == "/health":
                    stub.health_gets += 1
                    self._answer(stub.health, {"status": "ok" if stub.health == 200 else "loading model"})
                else:
                    self._answer(404, {"error": "not found"})

            def do_POST(self):
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                stub.chat_posts += 1
                if stub.chat == 200:
                    self._answer(200, ANSWER)
                else:
                    self._answer(stub.chat, {"error": {"message": "Loading model", "type": "unavailable_error",
                                                       "code": 503}}, {"Retry-After": "7"})

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        if tls is not None:
            self.server.socket = tls.wrap_socket(self.server.socket, server_side=True)
        scheme = "https" if tls is not None else "http"
        self.url = f"{scheme}://127.0.0.1:{self.server.server_port}"
        self._thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop serving and free the port."""
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def certificate(tmp_path_factory) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 (its own CA) and its key, made by the openssl command."""
    d = tmp_path_factory.mktemp("tls")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                    "-keyout", str(d / "key.pem"), "-out", str(d / "cert.pem"), "-days", "2", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1",
                    "-addext", "keyUsage=critical,digitalSignature,keyCertSign"],
                   check=True, capture_output=True)
    return d / "cert.pem", d / "key.pem"


@pytest.fixture
def stubs():
    """Factory of NodeStubs, all closed after the test."""
    made: list[NodeStub] = []

    def make(tls: ssl.SSLContext | None = None) -> NodeStub:
        made.append(NodeStub(tls))
        return made[-1]

    yield make
    for s in made:
        s.close()


@pytest.fixture
def starter(tmp_path_factory, standin_model):
    """Real serves on the stand-in model (nothing is ever loaded)."""
    s = ServeStarter(tmp_path_factory.mktemp, standin_model)
    yield s
    s.stop_all()


def serve_with_node(starter: ServeStarter, tmp_path: Path, standin_model: Path, model: str, node_url: str):
    """A serve whose models folder holds a copy of the stand-in named `model`, served only by `node_url`."""
    models = tmp_path / "models"
    models.mkdir(exist_ok=True)
    shutil.copyfile(standin_model, models / f"{model}.gguf")
    data = tmp_path / "data"
    engine, sessions = open_store(data)
    with sessions() as s:
        row = Model(name=model, source="folder", policy="keep_alive", first_seen_at=utcnow(), last_seen_at=utcnow())
        s.add(row)
        s.flush()
        s.add(Node(model_id=row.id, url=node_url, label="nas-2", enabled=True))
        s.commit()
    engine.dispose()
    return starter(models=models, data=data, settings=TIGHT)


def chat(served, model: str) -> httpx.Response:
    """One small chat request for `model` with alice's token."""
    return served.client.post("/v1/chat/completions", headers={"Authorization": f"Bearer {served.tokens['alice']}"},
                              json={"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})


def test_an_https_node_is_relayed_over_verified_tls(starter, stubs, tmp_path, standin_model, certificate, monkeypatch):
    cert, key = certificate
    tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    tls.load_cert_chain(cert, key)
    node = stubs(tls)
    assert node.url.startswith("https://")
    # The household's own CA (here the self-signed certificate itself) is named by HEARTH_NODE_CA_FILE.
    monkeypatch.setenv(NODE_CA_ENV, str(cert))
    served = serve_with_node(starter, tmp_path, standin_model, "tls-model", node.url)
    r = chat(served, "tls-model")
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == "hi from the node"
    assert r.headers["X-Hearth-Node"] == "nas-2" and node.chat_posts == 1


def test_an_https_node_with_an_unknown_certificate_is_not_trusted(stubs, certificate, monkeypatch):
    cert, key = certificate
    tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    tls.load_cert_chain(cert, key)
    node = stubs(tls)
    monkeypatch.delenv(NODE_CA_ENV, raising=False)
    assert not RemoteNode(node.url).healthy()
    monkeypatch.setenv(NODE_CA_ENV, str(cert))
    assert RemoteNode(node.url).healthy() and node.health_gets == 1


def test_a_busy_node_answers_503_and_stays_in_service(starter, stubs, tmp_path, standin_model):
    node = stubs()
    served = serve_with_node(starter, tmp_path, standin_model, "busy-model", node.url)

    def still_relayed(times: int) -> None:
        for _ in range(times):
            before = node.chat_posts
            r = chat(served, "busy-model")
            # The node's own answer reaches the client, Retry-After included: it was not judged down.
            assert r.status_code == 503 and r.headers["Retry-After"] == "7", r.text
            assert "Loading model" in r.text and node.chat_posts == before + 1

    node.chat = 503  # answers 503 to requests while /health is fine (full)
    still_relayed(3)
    node.health = 503  # and now /health too (llama-server while it loads its model)
    checks = node.health_gets
    wait_until(lambda: node.health_gets > checks, 20, "serve never checked the node again")
    still_relayed(2)
    node.health, node.chat = 200, 200
    assert chat(served, "busy-model").status_code == 200


def test_a_model_named_outside_latin1_is_served_with_its_name_percent_encoded(starter, stubs, tmp_path, standin_model):
    node = stubs()
    name = "модель-台所"
    served = serve_with_node(starter, tmp_path, standin_model, name, node.url)
    r = chat(served, name)
    assert r.status_code == 200, r.text
    assert unquote(r.headers["X-Hearth-Model"]) == name and r.headers["X-Hearth-Model"].isascii()
    listed = served.client.get("/v1/models", headers={"Authorization": f"Bearer {served.tokens['alice']}"})
    assert listed.status_code == 200 and name in [m["id"] for m in listed.json()["data"]]
    assert served.client.get("/healthz").status_code == 200
