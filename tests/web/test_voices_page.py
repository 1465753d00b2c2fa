"""Voices on the Models page: the embedded Piper voice first (the default), a folder voice with its speakers, a
corrupt .onnx shown with its error; once a voice has spoken, it shows as loaded with its load time and real-time
factor, and its RAM is taken from the models' budget."""

from __future__ import annotations

import json
import os

import pytest

from app.gateway.context import services
from app.speech.voices import RUNTIME_OVERHEAD_BYTES, embedded_voice
from app.web import fmt_bytes

pytestmark = pytest.mark.skipif(embedded_voice() is None, reason="pip install 'hearth[tts]'")


@pytest.fixture
def app(app, tmp_path):
    """The dashboard with a two-speaker voice (the embedded weights under another config) and a corrupt one."""
    models = tmp_path / "models"
    good = embedded_voice()
    config = json.loads(good.config.read_text())
    config["num_speakers"], config["speaker_id_map"] = 2, {"ann": 0, "bob": 1}
    config["language"]["code"] = "en_GB"
    os.symlink(good.model, models / "en_GB-pair-medium.onnx")
    (models / "en_GB-pair-medium.onnx.json").write_text(json.dumps(config))
    (models / "broken.onnx").write_bytes(os.urandom(4096))
    (models / "broken.onnx.json").write_text(json.dumps(config))
    yield app
    services(app).speech.stop()


def test_voices_are_listed_with_their_facts_and_a_corrupt_file_with_its_error(app, admin):
    html = admin.get("/models").get_data(as_text=True)
    section = html[html.index('id="voices"'):]
    embedded = section.index(f'data-voice="{embedded_voice().name}"')
    assert embedded < section.index('data-voice="broken"') < section.index('data-voice="en_GB-pair-medium"')
    assert "default" in section[embedded:section.index('data-voice="broken"')]
    assert "22,050 Hz" in section and "en_US" in section and "en_GB" in section and "(ann, bob)" in section
    assert fmt_bytes(embedded_voice().size_bytes) in section
    broken = section[section.index('data-voice="broken"'):]
    assert "broken.onnx is not an ONNX model" in broken[:broken.index("</tr>")]
    assert "speech process stopped" in section


def test_a_voice_that_spoke_is_loaded_and_counted_in_the_budget(app, admin):
    svc = services(app)
    before = svc.residency._budget_fn()
    voice = svc.speech.find(None)
    assert [f.kind for f in svc.speech.process.speak(voice, "Counted.", "raw")][-1] == "D"
    assert svc.speech.resident_bytes() == voice.size_bytes + RUNTIME_OVERHEAD_BYTES
    assert svc.residency._budget_fn() == before - svc.speech.resident_bytes()
    row = admin.get("/models").get_data(as_text=True).split(f'data-voice="{voice.name}"')[1].split("</tr>")[0]
    assert "loaded" in row and " ms" in row
    assert svc.speech.expire_idle() is False  # just used: kept
