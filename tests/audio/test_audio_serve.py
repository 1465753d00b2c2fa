"""Audio through a real `hearth serve`: a copy of the embedded model with the random Whisper-style projector paired
by name; /v1/audio/transcriptions (and /audio/transcriptions) relayed through the household's classes to the
runner's chat route, the class of the token or the one asked for, bad uploads refused at the gateway in OpenAI's
shape, and input_audio chat through serve."""

from __future__ import annotations

import base64
import json
import shutil

import pytest

from app.devtools import audio_files
from app.devtools.audio_mmproj import cached_audio_mmproj
from tests.helpers import SMALL_RUNNERS

AUDIO = "gemma-audio-Q4_K_M"

pytestmark = pytest.mark.skipif(bool(audio_files.encoders_missing()), reason="apt-get install flac lame")


@pytest.fixture(scope="module")
def aserve(start_shared_serve, tmp_path_factory, gemma_path):
    """A serve whose models folder holds a copy of Gemma and the audio projector named after it."""
    models = tmp_path_factory.mktemp("audio-models")
    shutil.copyfile(gemma_path, models / f"{AUDIO}.gguf")
    shutil.copyfile(cached_audio_mmproj(gemma_path), models / f"mmproj-{AUDIO}-f32.gguf")
    return start_shared_serve(models=models, settings={**SMALL_RUNNERS, "runner_ctx": 2048})


def _auth(serve, member: str = "alice") -> dict:
    return {"Authorization": f"Bearer {serve.tokens[member]}"}


def _transcribe(serve, path: str, data: bytes, **form):
    return serve.client.post(path, headers=_auth(serve), data={"model": AUDIO, "temperature": "0",
                                                                "max_tokens": "8", **form},
                             files={"file": ("clip.wav", data)})


@pytest.mark.parametrize("path", ["/v1/audio/transcriptions", "/audio/transcriptions"])
def test_a_transcription_through_serve_is_a_class_request(aserve, path):
    r = _transcribe(aserve, path, audio_files.sweep("wav", seconds=2.0))
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["type"] == "transcript.text.done" and body["usage"]["input_tokens"] > 750
    assert r.headers["X-Hearth-Model"] == AUDIO and r.headers["X-Hearth-Class"]


def test_the_class_asked_for_is_the_class_used(aserve):
    r = _transcribe(aserve, "/v1/audio/transcriptions", audio_files.sweep("flac", seconds=1.0), hearth_class="voice")
    assert r.status_code in (200, 403), r.text
    if r.status_code == 200:
        assert r.headers["X-Hearth-Class"] == "voice"


def test_text_and_stream_formats_through_serve(aserve):
    data = audio_files.sweep("mp3", seconds=1.5)
    # The first answer computes the whole prompt; a repeat reuses all of it but its last token, as llama-server's
    # slot does, and the random model's near-ties may tip on that: the formats are compared between repeats.
    _transcribe(aserve, "/v1/audio/transcriptions", data)
    whole = _transcribe(aserve, "/v1/audio/transcriptions", data).json()["text"]
    text = _transcribe(aserve, "/v1/audio/transcriptions", data, response_format="text")
    assert text.headers["content-type"].startswith("text/plain") and text.text == whole
    streamed = _transcribe(aserve, "/v1/audio/transcriptions", data, stream="true")
    events = [json.loads(line[6:]) for line in streamed.text.splitlines()
              if line.startswith("data: {")]
    assert events[-1]["type"] == "transcript.text.done"
    assert "".join(e.get("delta", "") for e in events) == events[-1]["text"]


@pytest.mark.parametrize(("data", "fragment"), [
    (audio_files.lying_wav(), "the header says"),
    (b"just some text", "not a WAV, MP3 or FLAC"),
    (audio_files.sweep("mp3")[:-200], "cut short"),
])
def test_bad_audio_is_a_400_in_openais_shape_and_serve_keeps_serving(aserve, data, fragment):
    r = _transcribe(aserve, "/v1/audio/transcriptions", data)
    assert r.status_code == 400 and fragment in r.json()["error"]["message"], r.text
    assert _transcribe(aserve, "/v1/audio/transcriptions", audio_files.sweep("wav", seconds=1.0)).status_code == 200


def test_input_audio_chat_through_serve(aserve):
    b64 = base64.b64encode(audio_files.sweep("wav", seconds=1.0)).decode()
    r = aserve.client.post("/v1/chat/completions", headers=_auth(aserve), json={
        "model": AUDIO, "max_tokens": 4, "temperature": 0, "messages": [{"role": "user", "content": [
            {"type": "text", "text": "What do you hear?"},
            {"type": "input_audio", "input_audio": {"data": b64, "format": "wav"}}]}]})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] > 750
    bad = aserve.client.post("/v1/chat/completions", headers=_auth(aserve), json={
        "model": AUDIO, "max_tokens": 4, "messages": [{"role": "user", "content": [
            {"type": "input_audio", "input_audio": {"data": base64.b64encode(audio_files.lying_wav()).decode(),
                                                    "format": "wav"}}]}]})
    assert bad.status_code == 400 and "the header says" in bad.json()["error"]["message"]


def test_the_openapi_document_describes_the_upload(aserve):
    doc = aserve.client.get("/openapi.json").json()
    post = doc["paths"]["/v1/audio/transcriptions"]["post"]
    assert "file" in post["requestBody"]["content"]["multipart/form-data"]["schema"]["properties"]


def test_ollama_show_and_the_models_page_say_audio_for_the_paired_model(aserve):
    show = aserve.client.post("/api/show", headers=_auth(aserve), json={"model": AUDIO}).json()
    assert "audio" in show["capabilities"] and "vision" not in show["capabilities"]
    plain = aserve.client.post("/api/show", headers=_auth(aserve), json={"model": "gemma-3-270m-q4_k_m"}).json()
    assert "audio" not in plain["capabilities"]


def test_projector_modalities_read_the_encoders(gemma_path, tmp_path):
    from app.devtools.mmproj import cached_mmproj
    from app.gguf_meta import projector_modalities

    assert projector_modalities(cached_audio_mmproj(gemma_path)) == (False, True)
    assert projector_modalities(cached_mmproj(gemma_path)) == (True, False)
    assert projector_modalities(None) == (False, False)


def test_a_transcription_is_logged_with_its_audio_and_timings_a_client_can_check(aserve):
    """The request log (and the Requests page) holds the file's own length, a TTFT no later than the client's first
    delta and a real-time factor from a total no longer than the client's own stopwatch."""
    import sqlite3
    import time

    from tests.helpers import wait_until

    def last_id() -> int:
        with sqlite3.connect(aserve.data / "hearth.db") as db:
            return db.execute("select coalesce(max(id), 0) from requests").fetchone()[0]

    before = last_id()
    data = audio_files.sweep("wav", seconds=2.5)
    t0 = time.perf_counter()
    first = None
    with aserve.client.stream("POST", "/v1/audio/transcriptions", headers=_auth(aserve),
                              data={"model": AUDIO, "temperature": "0", "max_tokens": "8", "stream": "true"},
                              files={"file": ("clip.wav", data)}) as r:
        for line in r.iter_lines():
            if first is None and "transcript.text.delta" in line:
                first = (time.perf_counter() - t0) * 1000
    total = (time.perf_counter() - t0) * 1000
    assert r.status_code == 200 and first is not None

    def row():
        with sqlite3.connect(aserve.data / "hearth.db") as db:
            return db.execute("select audio_seconds, ttft_ms, total_ms from requests where id > ? and "
                              "audio_seconds is not null and stream = 1", (before,)).fetchone()

    wait_until(lambda: row() is not None, 30, "the transcription's row")
    seconds, ttft_ms, total_ms = row()
    assert seconds == pytest.approx(2.5, abs=1e-3)
    assert 0 < ttft_ms <= first and 0 < total_ms <= total
    metrics = aserve.client.get("/metrics", headers=_auth(aserve)).text
    assert "hearth:gateway_audio_seconds_total" in metrics and "hearth:gateway_transcription_real_time_factor" in metrics
