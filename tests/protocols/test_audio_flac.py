"""A FLAC is checked to its last frame: STREAMINFO's length must be what the frames hold, and the file must end with
a whole frame (its CRC-16), so a cut-short FLAC is refused before libmtmd decodes a part of it as the whole."""

import numpy as np
import pytest

from app.devtools import audio_files
from app.protocols.audio import AudioLimits, _flac_frame_header, check_audio
from app.protocols.openai import ApiError

pytestmark = pytest.mark.skipif("flac" in audio_files.encoders_missing(), reason="apt-get install flac")

LIMITS = AudioLimits()


def refusal(data: bytes) -> str:
    with pytest.raises(ApiError) as caught:
        check_audio(data, "flac", "file", LIMITS)
    assert caught.value.status == 400
    return caught.value.message


@pytest.mark.parametrize(("seconds", "rate"), [(0.5, 16000), (5.0, 16000), (61.0, 16000), (3.0, 44100)])
def test_a_whole_flac_passes_with_its_own_length(seconds, rate):
    info = check_audio(audio_files.sweep("flac", seconds=seconds, rate=rate), "flac", "file", LIMITS)
    assert (info.sample_rate, info.channels) == (rate, 1) and info.seconds == pytest.approx(seconds, abs=1 / rate)


def test_a_stereo_flac_passes():
    pcm = audio_files.sweep_pcm(2.0)
    stereo = audio_files.wav_bytes(np.repeat(pcm, 2), channels=2)
    info = check_audio(audio_files.encode(stereo, "flac"), "flac", "file", LIMITS)
    assert info.channels == 2 and info.seconds == pytest.approx(2.0, abs=1e-3)


@pytest.mark.parametrize("keep", [0.999, 0.9, 0.5, 0.1])
def test_a_flac_cut_inside_its_frames_is_refused(keep):
    data = audio_files.sweep("flac", seconds=20.0)
    message = refusal(data[:int(len(data) * keep)])
    assert "truncated or corrupt" in message and "send the whole file" in message


def test_a_flac_cut_at_a_frame_boundary_says_how_much_it_holds():
    data = audio_files.sweep("flac", seconds=20.0)
    block = int.from_bytes(data[8:10], "big")
    last = max(p for p in range(len(data) - 16, len(data) // 2, -1) if _flac_frame_header(data, p, block))
    message = refusal(data[:last])
    assert "STREAMINFO says 320,000 samples, the frames hold" in message


@pytest.mark.parametrize(("cut", "says"), [(8 + 34, "the metadata blocks are cut short"),
                                           (-1, "no audio frames after the metadata")])
def test_a_flac_with_only_its_header_is_refused(cut, says):
    data = audio_files.sweep("flac", seconds=2.0)
    if cut < 0:  # every metadata block whole, not one frame after them
        pos = 4
        while not data[pos] & 0x80:
            pos += 4 + int.from_bytes(data[pos + 1:pos + 4], "big")
        cut = pos + 4 + int.from_bytes(data[pos + 1:pos + 4], "big")
    assert says in refusal(data[:cut])
