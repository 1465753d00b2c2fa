"""Audio in requests: taken from the messages (OpenAI's input_audio parts) and checked before libmtmd sees it.

libmtmd's helper decodes WAV, MP3 and FLAC with miniaudio, and it sizes its sample buffer from what the file's
header claims (mtmd-helper.cpp: ma_decoder_get_length_in_pcm_frames, then resize): a 44-byte WAV whose header
claims 2 GB of samples would allocate 4 GB. So each file is read here first, from its own structure: a WAV's
chunks against the bytes really there, a FLAC's STREAMINFO, an MP3's frames walked one by one; its duration,
sample rate and channels come from that, and a file whose header promises more than it holds (truncated, or
lying) is refused with a 400 naming the part, as is one over the limits (AudioLimits). The bytes go to libmtmd
as sent, so Hearth hears exactly what stock llama-server hears.
"""

from __future__ import annotations

import base64
import binascii
import struct
from dataclasses import dataclass

from app.protocols.openai import ApiError

FORMATS = ("wav", "mp3", "flac")
# The part type Hearth's prompts carry audio as (OpenAI's); other APIs' audio is translated to it.
PART_TYPE = "input_audio"


@dataclass(frozen=True)
class AudioLimits:
    """What one request's audio may be (llama-server has no such limits; these keep a household box safe)."""

    max_bytes: int = 20 * 1024 * 1024  # what a generation's body limit makes room for beside the text
    # Each second of audio is 25 embeddings (Qwen2-Audio, Whisper's 50 halved) and libmtmd decodes it to 64 KB of
    # floats: ten minutes is 15,000 positions and 38 MB.
    max_seconds: float = 600.0
    min_sample_rate: int = 8000
    max_sample_rate: int = 192000
    max_channels: int = 8
    max_parts: int = 8


@dataclass(frozen=True)
class AudioInfo:
    """What a checked audio file holds."""

    format: str
    sample_rate: int
    channels: int
    seconds: float


def audio_parts(messages: list[dict]) -> list[tuple[dict, str]]:
    """(input_audio, where) of every input_audio part, in prompt order; where is the part's path in the body."""
    found = []
    for i, m in enumerate(messages):
        content = m.get("content")
        if not isinstance(content, list):
            continue
        for j, part in enumerate(content):
            if isinstance(part, dict) and part.get("type") == PART_TYPE:
                found.append((part.get("input_audio") or {}, f"messages.{i}.content.{j}"))
    return found


def bad_audio(param: str, message: str, code: str = "invalid_audio") -> ApiError:
    """A 400 naming the audio part and what to send instead."""
    return ApiError(400, f"'{param}' {message}", param=param, code=code)


def load_audio(part: dict, where: str, limits: AudioLimits) -> tuple[bytes, AudioInfo]:
    """One input_audio part's file, decoded from base64 and checked (see check_audio)."""
    fmt = str(part.get("format") or "").lower()
    if fmt not in FORMATS:
        raise bad_audio(f"{where}.input_audio.format", f"is {fmt or 'missing'}: send wav, mp3 or flac",
                        code="unsupported_audio_format")
    payload = part.get("data")
    param = f"{where}.input_audio.data"
    if not isinstance(payload, str) or not payload:
        raise bad_audio(param, "is empty: send the audio file as base64")
    if payload.startswith("data:"):
        payload = payload.partition(",")[2]
    if len(payload) > limits.max_bytes * 4 // 3 + 4:
        raise _too_big(param, limits)
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise bad_audio(param, "is not valid base64: send the audio file base64-encoded")
    return data, check_audio(data, fmt, param, limits)


def check_audio(data: bytes, fmt: str, param: str, limits: AudioLimits) -> AudioInfo:
    """The file's format, rate, channels and duration, read from its structure; a 400 where it is not the format
    it says, is truncated, claims more than it holds, or is over the limits."""
    if len(data) > limits.max_bytes:
        raise _too_big(param, limits)
    if not data:
        raise bad_audio(param, "is empty")
    actual = sniff(data)
    if actual is None:
        raise bad_audio(param, f"is not a {fmt} file (nor any of WAV, MP3, FLAC): send the audio file itself",
                        code="unsupported_audio_format")
    if actual != fmt:
        raise bad_audio(param, f"is a {actual} file, not the {fmt} its format says: set format to {actual}",
                        code="unsupported_audio_format")
    reader = {"wav": _wav_info, "flac": _flac_info, "mp3": _mp3_info}[fmt]
    try:
        info = reader(data)
    except (struct.error, IndexError, ValueError) as exc:
        raise bad_audio(param, f"is truncated or corrupt ({exc}): send the whole file")
    if not limits.min_sample_rate <= info.sample_rate <= limits.max_sample_rate:
        raise bad_audio(param, f"has a sample rate of {info.sample_rate:,} Hz: send audio between "
                               f"{limits.min_sample_rate:,} and {limits.max_sample_rate:,} Hz", code="audio_sample_rate")
    if not 1 <= info.channels <= limits.max_channels:
        raise bad_audio(param, f"has {info.channels} channels: send mono or stereo audio")
    if info.seconds > limits.max_seconds:
        raise bad_audio(param, f"is {info.seconds:,.1f} s long, more than the limit of {limits.max_seconds:,.0f} s: "
                               "send it in shorter pieces", code="audio_too_long")
    if info.seconds <= 0:
        raise bad_audio(param, "holds no audio")
    return info


def sniff(data: bytes) -> str | None:
    """wav, flac or mp3 from the file's first bytes (None: none of them)."""
    if data[:4] == b"RIFF" and data[8:12] == b"WAVE":
        return "wav"
    if data[:4] == b"fLaC":
        return "flac"
    if data[:3] == b"ID3" or (len(data) > 1 and data[0] == 0xFF and data[1] & 0xE0 == 0xE0):
        return "mp3"
    return None


def _too_big(param: str, limits: AudioLimits) -> ApiError:
    return bad_audio(param, f"is larger than the audio limit of {limits.max_bytes:,} bytes: send it shorter or "
                            "compressed (mp3, flac)", code="audio_too_large")


def _wav_info(data: bytes) -> AudioInfo:
    """A WAV's fmt chunk, and its data chunk's length checked against the bytes that follow it."""
    pos, fmt_chunk = 12, None
    while pos + 8 <= len(data):
        cid, size = data[pos:pos + 4], struct.unpack_from("<I", data, pos + 4)[0]
        body = pos + 8
        if cid == b"fmt ":
            fmt_chunk = struct.unpack_from("<HHIIHH", data, body)
        elif cid == b"data":
            if fmt_chunk is None:
                raise ValueError("the data chunk comes before the fmt chunk")
            if body + size > len(data):
                raise ValueError(f"the header says {size:,} bytes of samples, the file holds {len(data) - body:,}")
            tag, channels, rate, _, block_align, bits = fmt_chunk
            if tag not in (1, 3, 0xFFFE) or bits not in (8, 16, 24, 32) or not block_align:
                raise ValueError(f"format tag {tag} with {bits} bits a sample is not PCM")
            if channels == 0 or rate == 0:
                raise ValueError("no channels or no sample rate")
            return AudioInfo("wav", rate, channels, size / block_align / rate)
        pos = body + size + (size & 1)
    raise ValueError("no data chunk")


def _flac_info(data: bytes) -> AudioInfo:
    """A FLAC's STREAMINFO: rate, channels and total samples (a file that does not say its length is refused)."""
    if data[4] & 0x7F != 0:
        raise ValueError("the first metadata block is not STREAMINFO")
    info = data[8 + 10:8 + 18]
    if len(info) < 8:
        raise ValueError("STREAMINFO is cut short")
    bits = int.from_bytes(info, "big")
    rate, channels, total = bits >> 44, ((bits >> 41) & 0x7) + 1, bits & ((1 << 36) - 1)
    if total == 0:
        raise ValueError("STREAMINFO does not say how many samples it holds")
    if rate == 0:
        raise ValueError("no sample rate")
    return AudioInfo("flac", rate, channels, total / rate)


# MPEG audio frame header tables: bit rates (kbit/s) by version and layer, sample rates by version.
_MP3_RATES = {3: (44100, 48000, 32000), 2: (22050, 24000, 16000), 0: (11025, 12000, 8000)}
_MP3_KBPS_V1_L3 = (0, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320)
_MP3_KBPS_V2_L3 = (0, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 144, 160)


def _mp3_info(data: bytes) -> AudioInfo:
    """An MP3's frames walked from the first to the last (after an ID3v2 tag): the duration is what they hold."""
    pos = 0
    if data[:3] == b"ID3":
        size = data[6:10]
        pos = 10 + (size[0] << 21 | size[1] << 14 | size[2] << 7 | size[3])
    rate = channels = 0
    samples = frames = 0
    while pos + 4 <= len(data):
        h = int.from_bytes(data[pos:pos + 4], "big")
        if h >> 21 != 0x7FF:
            if frames and data[pos:pos + 3] == b"TAG":  # an ID3v1 tag at the end
                break
            raise ValueError(f"no MPEG frame at byte {pos:,}")
        version, layer = (h >> 19) & 3, (h >> 17) & 3
        kbps_index, rate_index, padding = (h >> 12) & 0xF, (h >> 10) & 3, (h >> 9) & 1
        if version == 1 or layer != 1 or kbps_index in (0, 15) or rate_index == 3:
            raise ValueError(f"not an MPEG layer III frame at byte {pos:,}")
        rate = _MP3_RATES[version][rate_index]
        channels = 1 if (h >> 6) & 3 == 3 else 2
        kbps = (_MP3_KBPS_V1_L3 if version == 3 else _MP3_KBPS_V2_L3)[kbps_index]
        per_frame = 1152 if version == 3 else 576
        length = per_frame // 8 * kbps * 1000 // rate + padding
        if pos + length > len(data):
            raise ValueError(f"the last frame is cut short at byte {len(data):,}")
        samples += per_frame
        frames += 1
        pos += length
    if not frames:
        raise ValueError("no MPEG frames")
    return AudioInfo("mp3", rate, channels, samples / rate)
