"""The media fuzz tier's fast part (issue 50): seeded hostile WAV, MP3, FLAC, PNG and JPEG variants
(app.devtools.media_fuzz) and hypothesis' mutations of real files, through the checks each route runs before a
runner or libmtmd sees them: the upload's (the gateway's adapter), chat's input_audio and image parts, and Wyoming's
event reader. Whatever arrives: a 4xx naming the part, or a file the decoder can take (at least one encoder window,
within the length limit) — never another exception. More variants run through a real serve in
tests/audio/test_media_fuzz_serve.py (the model tier)."""

from __future__ import annotations

import base64
import json
import socket
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from app.devtools import audio_files
from app.devtools.media_fuzz import Variant, real_files, variants
from app.gateway.wyoming import StreamError, _Audio, _Budget, _read_event, _Reader, check_event_data
from app.protocols import audio, transcriptions
from app.protocols.openai import ApiError
from app.runner import images
from app.runner.config import ImageLimits

pytestmark = pytest.mark.skipif(bool(audio_files.encoders_missing()), reason="apt-get install flac lame")

LIMITS = audio.AudioLimits().for_projector("qwen2a")
FAST_COUNT = 80


def _accepted_audio_is_decodable(info: audio.AudioInfo) -> None:
    assert audio.resampled_frames(LIMITS.encoder_rate, info.sample_rate, info.frames) >= LIMITS.min_encoder_samples
    assert 0 < info.seconds <= LIMITS.max_seconds and 1 <= info.channels <= LIMITS.max_channels


def through_checks(v: Variant) -> str:
    """The variant through every route's check: 'ok' or the 4xx code (the same on every route)."""
    answers = set()
    if v.is_audio:
        try:  # the upload route (gateway and runner): sniffed, then checked once admitted
            adapter = transcriptions.from_upload({}, v.data, None, "m")
            _accepted_audio_is_decodable(adapter.check(LIMITS))
            answers.add("ok")
        except ApiError as err:
            assert 400 <= err.status < 500 and err.message, err
            answers.add("refused")
        part = {"format": v.fmt, "data": base64.b64encode(v.data).decode()}
        try:  # chat's input_audio part (gateway and runner)
            _, info = audio.load_audio(part, "messages[0].content[0]", LIMITS)
            _accepted_audio_is_decodable(info)
            answers.add("ok")
        except ApiError as err:
            assert 400 <= err.status < 500 and err.message, err
            answers.add("refused")
        assert len(answers) == 1 or not v.data, (v.name, answers)  # an empty upload is refused by its own rule
    else:
        url = f"data:image/{v.fmt};base64,{base64.b64encode(v.data).decode()}"
        try:
            images.load_image(url, "messages[0].content[0]", ImageLimits())
            answers.add("ok")
        except ApiError as err:
            assert 400 <= err.status < 500 and err.message, err
            answers.add("refused")
    return answers.pop()


@pytest.mark.parametrize("variant", list(variants(seed=0, count=FAST_COUNT)), ids=lambda v: v.name)
def test_every_variant_is_refused_with_a_4xx_or_decodable(variant):
    through_checks(variant)


def test_the_boundaries_land_on_the_right_side():
    by_name = {v.name: v for v in variants(seed=0, count=0)}
    for name in ("wav-1-frames", "wav-2-frames", "wav-100-frames", "wav-399-frames", "wav-8k-199-frames",
                 "wav-size-lies-2GB", "flac-frame-headers-130k", "mp3-xing-count-lies",
                 "png-claims-65535-square", "jpeg-claims-65500-square"):
        assert through_checks(by_name[name]) == "refused", name
    for name in ("wav-400-frames", "wav-401-frames", "wav-align-65535"):  # a lying block-align is not read
        assert through_checks(by_name[name]) == "ok", name


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(real_files()), st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), max_size=12),
       st.integers(0, 10**6))
def test_hypothesis_mutations_of_real_files_are_refused_or_decodable(base, writes, cut):
    data = bytearray(base.data)
    for at, value in writes:
        data[at % len(data)] = value
    through_checks(Variant(base.name, base.fmt, bytes(data[:max(1, cut % (len(data) + 1))])))


def _reader(payload: bytes) -> tuple[_Reader, list]:
    a, b = socket.socketpair()
    b.sendall(payload)
    b.shutdown(socket.SHUT_WR)
    return _Reader(a), [a, b]


@settings(max_examples=100, deadline=None)
@given(st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
                    max_leaves=10),
       st.sampled_from(["audio-start", "audio-chunk", "audio-stop", "transcribe", "describe", "x"]),
       st.binary(max_size=64))
def test_wyoming_events_of_any_shape_are_a_stream_error_or_taken(data, kind, payload):
    """Wyoming's route: any event data and payload is a StreamError (an error event) or an event Hearth can use."""
    header = {"type": kind, "data": data if isinstance(data, dict) else {"rate": data, "width": 2, "channels": 1}}
    if payload:
        header["payload_length"] = len(payload)
    reader, socks = _reader(json.dumps(header).encode() + b"\n" + payload)
    try:
        event = _read_event(reader, time.monotonic() + 5)
        check_event_data(event)
        if kind == "audio-start":
            from wyoming.audio import AudioStart

            _Audio(AudioStart.from_event(event), audio.AudioLimits(max_seconds=60), _Budget(1 << 20))
    except StreamError as err:
        assert err.code and str(err)
    finally:
        for sock in socks:
            sock.close()
