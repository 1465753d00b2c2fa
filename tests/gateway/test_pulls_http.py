"""Ollama's /api/pull and /api/show on the gateway (create_app, no runner): a pull that cannot go on
answers in Ollama's error shape with the status of why; show reads a model's file once per version."""

from __future__ import annotations

import os
import shutil

import pytest

from app.devtools.hub_server import HubServer, tiny_gguf
from app.gateway.context import services
from app.gateway.tokens import create_token
from app.store.settings import set_setting
from tests.helpers import dashboard_app

SECRET = "s3cr3t-signature"


@pytest.fixture()
def hub(tmp_path):
    src = tmp_path / "hub"
    src.mkdir()
    server = HubServer({"tiny-Q4_K_M.gguf": tiny_gguf(src / "tiny.gguf")})
    yield server
    server.close()


@pytest.fixture()
def gateway(tmp_path, standin_model, hub):
    """A gateway whose default model is a copy of the stand-in (its mtime is the test's to change),
    API model management on, and a token with the manage permission."""
    default = tmp_path / "default" / standin_model.name
    default.parent.mkdir()
    shutil.copyfile(standin_model, default)
    with dashboard_app(tmp_path, default) as app:
        with services(app).sessions() as s:
            set_setting(s, "api_manage_models", True)
            set_setting(s, "hf_endpoint", hub.url)
            token, _ = create_token(s, "admin-app", "chat", may_manage=True)
            s.commit()
        app.test_token = token
        app.default_path = default
        yield app


def _post(app, path: str, body: dict):
    return app.test_client().post(path, json=body, headers={"Authorization": f"Bearer {app.test_token}"})


@pytest.mark.parametrize("model, status, code, words", [
    ("http://127.0.0.1:9/files/x.gguf", 403, "host_refused", "a loopback address"),
    (f"http://192.168.1.1/x.gguf?token={SECRET}", 403, "host_refused", "a private address"),
    ("llama3.2", 400, "bad_source", "the Ollama registry is not supported"),
    ("hf.co/owner/repo:Q8_0", 404, "not_found", "no GGUF file of quantisation 'Q8_0'"),
])
def test_a_pull_that_cannot_go_on_answers_why_with_its_status(gateway, model, status, code, words):
    r = _post(gateway, "/api/pull", {"model": model, "stream": False})
    assert r.status_code == status, r.get_data(as_text=True)
    body = r.get_json()
    assert list(body) == ["error"] and words in body["error"] and SECRET not in body["error"]
    p = services(gateway).library.pulls()[0]
    assert p.code == code and SECRET not in p.label


def test_a_streamed_pull_of_a_lan_host_ends_with_an_error_line(gateway):
    r = _post(gateway, "/api/pull", {"model": "http://10.0.0.2/x.gguf"})
    lines = [line for line in r.get_data(as_text=True).splitlines() if line]
    assert r.status_code == 200 and '"pulling manifest"' in lines[0]
    assert "a private address" in lines[-1] and '"error"' in lines[-1]


def test_show_reads_the_file_once_per_version(gateway, monkeypatch):
    from app.residency import catalog

    reads = []
    real = catalog._read_facts
    monkeypatch.setattr(catalog, "_read_facts", lambda path: reads.append(path) or real(path))
    name = next(e.name for e in services(gateway).catalog.entries if e.source == "default")
    answers = [_post(gateway, "/api/show", {"model": name}) for _ in range(5)]
    assert {r.status_code for r in answers} == {200}
    assert all(r.get_json() == answers[0].get_json() for r in answers)
    assert answers[0].get_json()["model_info"]["general.architecture"] == "gemma3"
    assert len(reads) == 1
    os.utime(gateway.default_path, ns=(10**18, 10**18))  # the file changed under the same name
    assert _post(gateway, "/api/show", {"model": name}).status_code == 200 and len(reads) == 2
