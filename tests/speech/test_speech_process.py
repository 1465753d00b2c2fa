"""The TTS process with the real embedded Piper voice: every format written, a crashed process restarted on the next
request, a voice that cannot load refused, the best class's sentence first, Piper missing told plainly."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from app.speech import encode, piper_engine
from app.speech.client import SpeechProcess, SpeechRefused
from app.speech.voices import all_voices, describe, embedded_voice
from app.speech.worker import Gate

pytestmark = pytest.mark.skipif(embedded_voice() is None, reason="pip install 'hearth[tts]'")

TEXT = "Hello there. This is Hearth, speaking from the box. Goodbye!"


@pytest.fixture(scope="module")
def tts():
    proc = SpeechProcess(lambda: 1)
    yield proc
    proc.stop()


def _speak(tts, text=TEXT, fmt="pcm", voice=None, **kw) -> tuple[bytes, dict]:
    audio, done = b"", {}
    for f in tts.speak(voice or embedded_voice(), text, fmt, **kw):
        if f.kind == "A":
            audio += f.payload
        elif f.kind == "D":
            done = f.json()
        assert f.kind != "E", f.payload
    return audio, done


def _wait(condition, timeout_s=30.0):
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


def test_the_embedded_voice_speaks_every_sentence(tts):
    audio, done = _speak(tts)
    assert done["sentences"] == 3 and done["sample_rate"] == 22050
    # pcm is OpenAI's 24 kHz: its length is the voice's audio, resampled.
    assert len(audio) / 2 / encode.PCM_RATE == pytest.approx(done["audio_seconds"], rel=0.001)


def test_speed_changes_the_length(tts):
    _, normal = _speak(tts, "The quick brown fox jumps over the lazy dog.")
    _, fast = _speak(tts, "The quick brown fox jumps over the lazy dog.", speed=2.0)
    assert fast["audio_seconds"] < normal["audio_seconds"] * 0.7


def test_a_crashed_process_is_restarted_on_the_next_request(tts):
    _speak(tts, "First.")
    pid, starts = tts.pid, tts.starts
    os.kill(pid, signal.SIGKILL)
    _wait(lambda: tts.pid is None)
    audio, done = _speak(tts, "Second.")
    assert audio and tts.starts == starts + 1 and tts.pid != pid


def test_a_corrupt_voice_is_described_with_its_error_and_refused_by_the_process(tts, tmp_path):
    good = embedded_voice()
    (tmp_path / "broken.onnx").write_bytes(b"\x08" + os.urandom(4096))
    (tmp_path / "broken.onnx.json").write_bytes(good.config.read_bytes())
    (tmp_path / "text.onnx").write_bytes(b"not a model at all" * 100)
    (tmp_path / "text.onnx.json").write_bytes(good.config.read_bytes())
    (tmp_path / "lonely.onnx").write_bytes(good.model.read_bytes()[:2048])
    voices = {v.name: v for v in all_voices(tmp_path)}
    assert voices[good.name].embedded and voices[good.name].error is None
    assert "not an ONNX model" in voices["text"].error
    assert "lonely.onnx.json is missing" in voices["lonely"].error
    with pytest.raises(SpeechRefused) as err:
        _speak(tts, voice=voices["broken"])
    assert err.value.status == 400 and "cannot be loaded" in str(err.value)
    assert _speak(tts, "Still here.")[0]


def test_a_bad_config_is_an_error_not_a_crash(tmp_path):
    (tmp_path / "v.onnx").write_bytes(b"\x08" + bytes(4096))
    (tmp_path / "v.onnx.json").write_text('{"audio": {"sample_rate": "fast"}}')
    assert "not a Piper voice config" in describe("v", tmp_path / "v.onnx", tmp_path / "v.onnx.json").error


def test_the_best_class_goes_first_between_sentences():
    gate, order = Gate(), []
    gate.enter(5)  # a background sentence is being spoken
    waiting = [threading.Thread(target=lambda p=p: (gate.enter(p), order.append(p), gate.leave())) for p in (9, 0, 5)]
    for t in waiting:
        t.start()
    _wait(lambda: len(gate._waiting) == 3)
    gate.leave()
    for t in waiting:
        t.join()
    assert order == [0, 5, 9]


def test_without_piper_the_error_names_the_extra(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "piper", None)
    with pytest.raises(piper_engine.SpeechUnavailable, match=r"hearth\[tts\]"):
        piper_engine.load("v", "v.onnx", "v.onnx.json", 1)


def test_the_idle_process_stops_but_never_under_a_job(tmp_path):
    from app.speech.client import Speech

    speech = Speech(lambda: tmp_path, lambda: 1, keep_alive_s=lambda: 0.0)
    try:
        frames = speech.process.speak(speech.find(None), TEXT, "pcm")
        assert next(frames).kind == "M" and speech.process.in_flight == 1
        assert speech.expire_idle() is False and speech.process.pid is not None  # a job is being read
        assert [f.kind for f in frames][-1] == "D" and speech.process.in_flight == 0
        assert speech.resident_bytes() > embedded_voice().size_bytes
        assert speech.expire_idle() is True and speech.process.pid is None and speech.resident_bytes() == 0
    finally:
        speech.stop()
