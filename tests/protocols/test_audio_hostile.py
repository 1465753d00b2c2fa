"""Hostile audio against the checks of app.protocols.audio (issue 50): the crafted-frame-header FLACs cost a bounded
number of header parses and one linear pass, the suffix CRC-16s agree with FLAC's own CRC, lengths are what
miniaudio's decoders read (a WAV's block-align and an MP3's Xing count), and audio too short for the projector's
encoder window is a 400 that says so."""

from __future__ import annotations

import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from app.devtools import audio_files
from app.protocols import audio
from app.protocols.audio import MAX_FLAC_CANDIDATES, AudioLimits, _crc16, _whole_suffixes, check_audio, resampled_frames
from app.protocols.openai import ApiError

WHISPER = AudioLimits().for_projector("qwen2a")


def refusal(data: bytes, fmt: str, limits: AudioLimits = WHISPER) -> ApiError:
    with pytest.raises(ApiError) as caught:
        check_audio(data, fmt, "file", limits)
    assert caught.value.status == 400
    return caught.value


@pytest.mark.parametrize("size", [130_000, 1_000_000])
def test_the_frame_header_flacs_are_refused_after_a_bounded_number_of_header_parses(size, monkeypatch):
    calls = []
    real = audio._flac_frame_header
    monkeypatch.setattr(audio, "_flac_frame_header", lambda *a: calls.append(a) or real(*a))
    # Somewhere a suffix of the repeated copies is a CRC-16 codeword (a "frame" of header copies ending the file),
    # but one far longer than a 4,096-sample block can be: no frame, so the file is cut short.
    err = refusal(audio_files.frame_header_flac(size), "flac")
    assert "cut short" in err.message
    # The headers whose CRC-16 to the end holds are parsed, at most the cap: main parsed every one of ~21,000 and
    # ran a CRC-16 over the rest of the file for each (minutes for 130 KB).
    assert len(calls) <= MAX_FLAC_CANDIDATES


def test_a_tail_of_whole_crafted_frames_is_tried_only_up_to_the_cap(monkeypatch):
    # 4,000 sync codes whose CRC-8 is wrong, the file's CRC-16 from the first of them right: main parsed every one
    # (each with a CRC-16 over the rest); here only those whose CRC-16 holds, at most the cap.
    head = audio_files.flac_streaminfo(4096)
    piece = bytes([0xFF, 0xF8, 0xC0, 0x00, 0x00, 0x00])  # CRC-8 wrong: never a header
    body = bytearray(piece * 4000)
    calls = []
    real = audio._flac_frame_header
    monkeypatch.setattr(audio, "_flac_frame_header", lambda *a: calls.append(a) or real(*a))
    tail = _crc16(bytes(body)).to_bytes(2, "big")
    refusal(head + bytes(body) + tail, "flac")
    assert len(calls) <= MAX_FLAC_CANDIDATES


@settings(max_examples=60, deadline=None)
@given(st.binary(min_size=1, max_size=1500), st.integers(min_value=0, max_value=1499))
def test_whole_suffixes_are_where_flacs_crc16_is_zero(data, at):
    at %= len(data)
    # Make the suffix from `at` a codeword (its CRC-16 appended), as a whole last frame is.
    data = data[:at] + data[at:] + _crc16(data[at:]).to_bytes(2, "big")
    got = _whole_suffixes(data)
    assert got[at]
    assert list(got) == [_crc16(data[p:]) == 0 for p in range(len(data))]


def _wav(frames: int, rate: int = 16000, bits: int = 16, channels: int = 1, block_align: int | None = None,
         tag: int = 1) -> bytes:
    """A PCM WAV of silence whose fmt fields may lie."""
    size = frames * bits // 8 * channels
    align = bits // 8 * channels if block_align is None else block_align
    fmt = struct.pack("<HHIIHH", tag, channels, rate, rate * align, align, bits)
    return b"RIFF" + struct.pack("<I", 36 + size) + b"WAVEfmt " + struct.pack("<I", 16) + fmt + b"data" \
        + struct.pack("<I", size) + bytes(size)


def test_a_wavs_block_align_is_not_trusted_for_its_length():
    # Issue 50: 900 s of 8-bit 8 kHz audio with block-align 65535 was read as 0.014 s; dr_wav reads 900 s.
    err = refusal(_wav(900 * 8000, rate=8000, bits=8, block_align=65535), "wav")
    assert err.code == "audio_too_long" and "900.0 s" in err.message
    info = check_audio(_wav(16000, block_align=7), "wav", "file", WHISPER)
    assert info.seconds == 1.0 and info.frames == 16000


def test_an_extensible_wav_must_be_pcm_or_float_inside():
    wav = bytearray(_wav(16000))
    fmt = struct.pack("<HHIIHHHHI", 0xFFFE, 1, 16000, 32000, 2, 16, 22, 16, 4) + struct.pack("<H", 2) + bytes(14)
    ext = bytes(wav[:16]) + struct.pack("<I", 40) + fmt + bytes(wav[36:])
    assert "not PCM" in refusal(ext, "wav").message  # sub-format 2: ADPCM, whose length dr_wav takes from a fact chunk


@pytest.mark.parametrize("frames", [1, 100, 399])
def test_a_wav_shorter_than_one_encoder_window_is_a_400_that_says_so(frames):
    err = refusal(_wav(frames), "wav")
    assert err.code == "audio_too_short" and "too short" in err.message and "400 of its one analysis window" in err.message


def test_one_window_is_enough_and_other_rates_count_after_resampling():
    assert check_audio(_wav(400), "wav", "file", WHISPER).frames == 400
    # 8 kHz: libmtmd's decoder doubles the frames, so 200 frames are a window and 199 are not.
    assert resampled_frames(16000, 8000, 200) >= 400 > resampled_frames(16000, 8000, 199)
    check_audio(_wav(200, rate=8000), "wav", "file", WHISPER)
    refusal(_wav(199, rate=8000), "wav")


def test_an_unknown_projector_gets_the_strictest_window():
    assert AudioLimits().for_projector("no-such-encoder") == AudioLimits()
    assert AudioLimits().for_projector(None).min_encoder_samples == max(w for _, w in audio.ENCODER_WINDOWS.values())
    refusal(_wav(600), "wav", AudioLimits())  # 37.5 ms: a whisper window, not a 1,024-sample one at 24 kHz


def test_resampled_frames_is_miniaudios_formula():
    assert resampled_frames(16000, 16000, 123) == 123
    assert resampled_frames(16000, 44100, 0) == 0
    # (frames * out // in), plus one where miniaudio's preliminary input count fits: worked by hand from miniaudio.h.
    assert resampled_frames(16000, 48000, 3) == 2
    assert resampled_frames(16000, 44100, 1152) == 417  # 417.96: no extra frame here (5,045,700 > 1,152)


def test_an_mp3s_length_is_dr_mp3s_info_frame_excluded_and_lame_delay_removed():
    info = check_audio(audio_files.sweep("mp3", seconds=1.0), "mp3", "file", WHISPER)
    assert info.frames == 16000 and info.seconds == 1.0


def test_an_mp3_whose_xing_count_lies_is_refused():
    data = bytearray(audio_files.sweep("mp3", seconds=1.0))
    at = data.find(b"Info")
    assert at > 0 and data[at + 7] & 1
    data[at + 8:at + 12] = (10_000_000).to_bytes(4, "big")  # dr_mp3 would size its decode by 5.76e9 samples
    err = refusal(bytes(data), "mp3")
    assert "Xing header says 10,000,000 frames" in err.message


def test_a_flac_of_one_sample_is_too_short():
    pcm = np.zeros(1, dtype=np.int16)
    data = audio_files.encode(audio_files.wav_bytes(pcm), "flac")
    assert refusal(data, "flac").code == "audio_too_short"
