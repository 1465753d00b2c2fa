"""The Models page's library: pull form, a progress section that polls itself until 286, delete."""


import pytest

from app.devtools.hub_server import HubServer, tiny_gguf
from app.gateway.context import services
from app.store.settings import set_setting
from tests.helpers import wait_until


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


def pulls_ended(admin):
    """A condition for wait_until: the pulls section once it stops polling (no longer a 200), else None."""
    def poll():
        page = admin.get("/models/pulls")
        return page if page.status_code != 200 else None
    return poll


def test_pull_shows_progress_lands_the_model_and_delete_removes_it(app, admin, csrf_token, tmp_path):
    page = admin.get("/models").get_data(as_text=True)
    assert "Add a model" in page and 'name="source"' in page
    r = admin.post("/models/pull", data={"source": "hf.co/owner/repo:Q4_K_M", "csrf_token": csrf_token(admin, "/models")},
                   headers={"HX-Request": "true"})
    assert r.status_code == 200 and "hf.co/owner/repo:Q4_K_M" in r.get_data(as_text=True)
    def ended():
        poll = admin.get("/models/pulls")
        if poll.status_code == 200:  # still running: the section polls again
            assert 'hx-trigger="every 1s"' in poll.get_data(as_text=True)
            return None
        return poll

    poll = wait_until(ended, 30, "the pull never ended")
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
    poll = wait_until(pulls_ended(admin), 10, "the pull never ended")
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
    poll = wait_until(pulls_ended(admin), 10, "the pull never ended")
    html = poll.get_data(as_text=True)
    assert "https://10.20.30.40/repo/model.gguf?X-Amz-Signature=***" in html and secret not in html
    assert "Refused" in html and "a private address" in html
