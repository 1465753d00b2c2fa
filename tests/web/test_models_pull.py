"""The Models page's library: pull form, a progress section that polls itself until 286, delete."""

import time

import pytest

from app.devtools.hub_server import HubServer, tiny_gguf
from app.gateway.context import services
from app.store.settings import set_setting


@pytest.fixture
def hub(tmp_path):
    src = tmp_path / "hub"
    src.mkdir()
    server = HubServer({"tiny-Q4_K_M.gguf": tiny_gguf(src / "tiny.gguf")})
    yield server
    server.close()


@pytest.fixture
def app(app, hub):
    with services(app).sessions() as s:
        set_setting(s, "hf_endpoint", hub.url)
        s.commit()
    return app


def test_pull_shows_progress_lands_the_model_and_delete_removes_it(app, admin, csrf_token, tmp_path):
    page = admin.get("/models").get_data(as_text=True)
    assert "Add a model" in page and 'name="source"' in page
    r = admin.post("/models/pull", data={"source": "hf.co/owner/repo:Q4_K_M", "csrf_token": csrf_token(admin, "/models")},
                   headers={"HX-Request": "true"})
    assert r.status_code == 200 and "hf.co/owner/repo:Q4_K_M" in r.get_data(as_text=True)
    deadline = time.monotonic() + 30
    while (poll := admin.get("/models/pulls")).status_code == 200:
        assert 'hx-trigger="every 1s"' in poll.get_data(as_text=True)
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert poll.status_code == 286
    html = poll.get_data(as_text=True)
    assert "done" in html and "hx-trigger" not in html  # finished: the section stops polling
    assert (tmp_path / "models" / "tiny-Q4_K_M.gguf").exists()
    assert "tiny-Q4_K_M" in admin.get("/models").get_data(as_text=True)
    r = admin.post("/models/tiny-Q4_K_M/delete", data={"csrf_token": csrf_token(admin, "/models")},
                   headers={"HX-Request": "true"})
    assert r.status_code == 200 and not (tmp_path / "models" / "tiny-Q4_K_M.gguf").exists()


def test_a_refused_pull_says_why(app, admin, csrf_token):
    admin.post("/models/pull", data={"source": "llama3.2", "csrf_token": csrf_token(admin, "/models")},
               headers={"HX-Request": "true"})
    deadline = time.monotonic() + 10
    while (poll := admin.get("/models/pulls")).status_code == 200:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert "Ollama registry is not supported" in poll.get_data(as_text=True)


def test_the_embedded_model_cannot_be_deleted(app, admin, csrf_token):
    name = next(e.name for e in services(app).catalog.entries if e.source == "default")
    r = admin.post(f"/models/{name}/delete", data={"csrf_token": csrf_token(admin, "/models")}, headers={"HX-Request": "true"})
    assert r.status_code == 409 and "embedded default model" in r.get_data(as_text=True)


def test_a_signed_url_is_shown_without_its_token(app, admin, csrf_token):
    secret = "s3cr3t-signature"
    source = f"https://10.20.30.40/repo/model.gguf?X-Amz-Signature={secret}"
    admin.post("/models/pull", data={"source": source, "csrf_token": csrf_token(admin, "/models")},
               headers={"HX-Request": "true"})
    deadline = time.monotonic() + 10
    while (poll := admin.get("/models/pulls")).status_code == 200:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    html = poll.get_data(as_text=True)
    assert "https://10.20.30.40/repo/model.gguf?X-Amz-Signature=***" in html and secret not in html
    assert "Refused" in html and "a private address" in html
