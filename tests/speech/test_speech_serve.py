"""POST /v1/audio/speech through a real `hearth serve` with the real embedded Piper voice: the official openai client
(whole and streamed), every format decoded back to its length, SSE deltas, the token's class, bad input as 400s in
OpenAI's shape, the request log and /metrics, and a killed TTS process restarted on the next request."""

from __future__ import annotations

import base64
import json
import os
import shutil
import signal
import struct
import subprocess
import time

import httpx
import psutil
import pytest
from sqlalchemy import select

from app.speech import sndfile
from app.speech.voices import embedded_voice
from app.store.db import open_store
from app.store.models import RequestRecord
from tests.helpers import ServeStarter

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(embedded_voice() is None or not shutil.which("lame") or not shutil.which("flac"),
                                 reason="pip install 'hearth[tts]'; apt-get install flac lame")]

SHORT = "Hello from the household's own server."
# Long enough that an MP3 decoder's delay and padding (about 0.1 s) stay within 2 % of the audio.
LONG = ("The kitchen lights are off. The front door is locked, and the garage door is closed. Tomorrow will be "
        "sunny with a high of twenty one degrees, so the washing can go outside. Sleep well, everyone!")


@pytest.fixture(scope="module")
def sserve(tmp_path_factory, standin_model):
    starter = ServeStarter(tmp_path_factory.mktemp, standin_model)
    yield starter(settings={"tts_threads": 1})
    starter.stop_all()


def _auth(serve, member="alice") -> dict:
    return {"Authorization": f"Bearer {serve.tokens[member]}"}


def _openai(serve, member="alice"):
    from openai import OpenAI

    return OpenAI(base_url=f"{serve.url}/v1", api_key=serve.tokens[member], timeout=120, max_retries=0)


def _wait(condition, timeout_s=60.0):
    deadline = time.monotonic() + timeout_s
    while not (value := condition()):
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)
    return value


def _sse(serve, text, fmt) -> tuple[bytes, dict]:
    r = serve.client.post("/v1/audio/speech", headers=_auth(serve), json={
        "model": "tts-1", "voice": "alloy", "input": text, "response_format": fmt, "stream_format": "sse"})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream"), r.text
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
    assert {e["type"] for e in events[:-1]} == {"speech.audio.delta"} and events[-1]["type"] == "speech.audio.done"
    return b"".join(base64.b64decode(e["audio"]) for e in events[:-1]), events[-1]["usage"]


def _decoded_seconds(fmt: str, data: bytes) -> float:
    """The file decoded back by its own tools (or its header), in seconds of 16-bit mono audio."""
    if fmt == "wav":
        assert data[:4] == b"RIFF" and data[8:16] == b"WAVEfmt " and data[36:40] == b"data"
        channels, rate, _, _, bits = struct.unpack("<HIIHH", data[22:36])
        assert (channels, bits) == (1, 16)
        return (len(data) - 44) / 2 / rate
    if fmt == "pcm":
        return len(data) / 2 / 24000
    if fmt == "opus":
        assert data[:4] == b"OggS" and b"OpusHead" in data[:64]
        frames, rate = sndfile.read_info(data)
        return frames / rate
    command = {"mp3": ["lame", "--quiet", "--decode", "-t", "--mp3input", "-", "-"],
               "flac": ["flac", "--silent", "-d", "--force-raw-format", "--endian=little", "--sign=signed", "-c", "-"]}
    raw = subprocess.run(command[fmt], input=data, capture_output=True, check=True).stdout
    return len(raw) / 2 / 22050


@pytest.mark.parametrize("fmt", ["wav", "pcm", "mp3", "flac",
                                 pytest.param("opus", marks=pytest.mark.skipif(not sndfile.opus_writable(),
                                                                               reason="apt-get install libsndfile1"))])
def test_each_format_decodes_back_to_the_audio_it_spoke(sserve, fmt):
    data, usage = _sse(sserve, LONG, fmt)
    assert usage["input_tokens"] == len(LONG) and usage["audio_seconds"] > 5
    assert _decoded_seconds(fmt, data) == pytest.approx(usage["audio_seconds"], rel=0.02)


def test_the_official_client_speaks_whole_and_streamed(sserve):
    client = _openai(sserve)
    whole = client.audio.speech.create(model="tts-1", voice="alloy", input=SHORT, response_format="wav")
    assert 1.0 < _decoded_seconds("wav", whole.content) < 10.0
    chunks = []
    with client.audio.speech.with_streaming_response.create(model="tts-1", voice="nova", input=LONG,
                                                            response_format="pcm") as response:
        assert response.headers["content-type"] == "audio/pcm"
        chunks = list(response.iter_bytes())
    assert len(chunks) > 1 and 5.0 < _decoded_seconds("pcm", b"".join(chunks)) < 30.0


def test_a_voice_by_name_and_the_class_of_the_token(sserve):
    voice = embedded_voice().name
    r = sserve.client.post("/v1/audio/speech", headers=_auth(sserve, "kid"),
                           json={"model": voice, "input": SHORT, "response_format": "flac"})
    assert r.status_code == 200 and r.headers["X-Hearth-Class"] == "voice" and r.headers["X-Hearth-Voice"] == voice
    assert r.content[:4] == b"fLaC"
    r = sserve.client.post("/v1/audio/speech", headers={**_auth(sserve), "X-Hearth-Class": "voice"},
                           json={"model": "tts-1", "voice": voice, "input": SHORT, "response_format": "mp3"})
    assert r.status_code == 200 and r.headers["X-Hearth-Class"] == "voice" and r.headers["content-type"] == "audio/mpeg"


@pytest.mark.parametrize(("body", "param", "code"), [
    ({"input": ""}, "input", "empty_input"),
    ({"input": "   \n "}, "input", "empty_input"),
    ({"input": "a" * 100 * 1024}, "input", "input_too_long"),
    ({"input": "ring \x07 the bell"}, "input", "control_character"),
    ({"input": SHORT, "voice": "no-such-voice"}, "voice", "unknown_voice"),
    ({"input": SHORT, "response_format": "ogg"}, "response_format", "unsupported_format"),
    ({"input": SHORT, "speed": 9}, "speed", "speed_out_of_range"),
])
def test_bad_input_is_a_400_in_openais_shape_and_serve_keeps_serving(sserve, body, param, code):
    r = sserve.client.post("/v1/audio/speech", headers=_auth(sserve), json={"model": "tts-1", **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["param"], err["code"], err["type"]) == (param, code, "invalid_request_error") and err["message"]
    assert sserve.client.post("/v1/audio/speech", headers=_auth(sserve),
                              json={"model": "tts-1", "voice": "alloy", "input": "Still here."}).status_code == 200


def test_a_format_without_its_encoder_is_a_400_naming_what_to_install():
    from app.protocols.openai import ApiError
    from app.protocols.speech import SpeechBody, check

    with pytest.raises(ApiError) as err:
        check(SpeechBody(input=SHORT, response_format="opus"), ["wav", "pcm"])
    assert err.value.status == 400 and "libsndfile1" in err.value.message and err.value.param == "response_format"


def test_a_token_is_needed(sserve):
    r = sserve.client.post("/v1/audio/speech", json={"model": "tts-1", "input": SHORT})
    assert r.status_code == 401 and r.json()["error"]["code"] == "missing_token"


def _metric(serve, name: str, klass: str) -> float:
    text = serve.client.get("/metrics", headers=_auth(serve)).text
    for line in text.splitlines():
        if line.startswith(f'{name}{{class="{klass}"}}'):
            return float(line.split()[-1])
    return 0.0


def test_metrics_count_characters_audio_and_first_audio(sserve):
    before = _metric(sserve, "hearth:gateway_speech_characters_total", "voice")
    r = sserve.client.post("/v1/audio/speech", headers=_auth(sserve, "kid"), json={"input": SHORT,
                                                                                  "response_format": "pcm"})
    assert r.status_code == 200
    _wait(lambda: _metric(sserve, "hearth:gateway_speech_characters_total", "voice") == before + len(SHORT))
    assert _metric(sserve, "hearth:gateway_speech_audio_seconds_total", "voice") > 0
    assert _metric(sserve, "hearth:gateway_speech_first_audio_seconds_count", "voice") >= 1
    assert _metric(sserve, "hearth:gateway_speech_real_time_factor_count", "voice") >= 1
    row = _wait(lambda: _speech_row(sserve, "kid"))
    assert (row.input_chars, row.class_name, row.features, row.status) == (len(SHORT), "voice", "speech", "ok")
    assert row.audio_seconds > 1 and 0 < row.ttft_ms <= row.total_ms and row.model == embedded_voice().name


def _speech_row(serve, member):
    engine, sessions = open_store(serve.data)
    try:
        with sessions() as s:
            return s.scalar(select(RequestRecord).where(RequestRecord.member_name == member,
                                                        RequestRecord.features == "speech"))
    finally:
        engine.dispose()


def _tts_pids(serve) -> list[int]:
    out = []
    for p in psutil.Process(serve.proc.pid).children(recursive=True):
        try:
            if "app.speech.worker" in " ".join(p.cmdline()):
                out.append(p.pid)
        except psutil.NoSuchProcess:
            continue
    return out


def test_a_killed_tts_process_is_restarted_on_the_next_request(sserve):
    assert sserve.client.post("/v1/audio/speech", headers=_auth(sserve), json={"input": SHORT}).status_code == 200
    (pid,) = _tts_pids(sserve)
    os.kill(pid, signal.SIGKILL)
    _wait(lambda: pid not in _tts_pids(sserve) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE)
    statuses = [sserve.client.post("/v1/audio/speech", headers=_auth(sserve), json={"input": SHORT}).status_code
                for _ in range(2)]
    # The first may still find the dead process (a 502 naming the restart); the next is spoken by a new one.
    assert statuses[-1] == 200 and statuses[0] in (200, 502)
    assert _tts_pids(sserve) and pid not in _tts_pids(sserve)
    assert httpx.get(f"{sserve.url}/healthz").status_code == 200


def test_a_client_that_leaves_mid_speech_is_logged_cancelled_and_the_next_is_served(sserve):
    text = " ".join([LONG] * 6)
    with httpx.Client(base_url=sserve.url, timeout=120) as c:
        with c.stream("POST", "/v1/audio/speech", headers=_auth(sserve, "kid"),
                      json={"input": text, "response_format": "pcm"}) as r:
            assert r.status_code == 200
            next(r.iter_bytes())  # the first sentence has come; the client goes
    row = _wait(lambda: _speech_row_where(sserve, "kid", len(text)))
    assert row.status == "cancelled" and row.http_status == 499
    assert sserve.client.post("/v1/audio/speech", headers=_auth(sserve), json={"input": SHORT}).status_code == 200


def _speech_row_where(serve, member, chars):
    engine, sessions = open_store(serve.data)
    try:
        with sessions() as s:
            return s.scalar(select(RequestRecord).where(RequestRecord.member_name == member,
                                                        RequestRecord.input_chars == chars))
    finally:
        engine.dispose()
