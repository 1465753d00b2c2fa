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
from dataclasses import dataclass, replace
from functools import cache

import numpy as np

from app.protocols.openai import ApiError, content_parts

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
    # The projector's encoder: libmtmd's helper resamples every file to its rate, and one window of its
    # spectrogram is the least audio it can encode (mtmd.cpp asserts on a single sample). Unset: the most
    # demanding of libmtmd's audio encoders (ENCODER_WINDOWS), for a model whose projector is not read here.
    encoder_rate: int = 24000
    min_encoder_samples: int = 1024

    def for_projector(self, projector_type: str | None) -> AudioLimits:
        """These limits with the encoder window of a projector type (clip.cpp's name, e.g. "qwen2a")."""
        rate, window = ENCODER_WINDOWS.get(projector_type or "", (self.encoder_rate, self.min_encoder_samples))
        return replace(self, encoder_rate=rate, min_encoder_samples=window)


# libmtmd's audio encoders (clip.cpp's hparams per projector type): (sample rate, samples in one analysis window,
# the larger of n_fft and the window length: the spectrogram's first frame needs that many).
_WHISPER = (16000, 400)
ENCODER_WINDOWS: dict[str, tuple[int, int]] = {
    **dict.fromkeys(("qwen2a", "ultravox", "voxtral", "qwen2.5o", "glma", "meralion", "musicflamingo", "qwen3a",
                     "dots3note_a"), _WHISPER),
    **dict.fromkeys(("lfm2a", "parakeet", "granite_speech", "gemma4a"), (16000, 512)),
    "gemma4ua": (16000, 640),  # encoder-free: the waveform in 640-sample frames
    "qwen3tts_spkenc": (24000, 1024),
    "mimo_audio": (24000, 960),
}


@dataclass(frozen=True)
class AudioInfo:
    """What a checked audio file holds."""

    format: str
    sample_rate: int
    channels: int
    seconds: float
    frames: int = 0  # samples a channel, as the decoder (miniaudio's dr_wav, dr_flac, dr_mp3) counts them


def resampled_frames(rate_out: int, rate_in: int, frames: int) -> int:
    """How many frames miniaudio's decoder reports after resampling (ma_calculate_frame_count_after_resampling):
    the length libmtmd sizes its sample buffer by."""
    if not (rate_out and rate_in and frames):
        return 0
    if rate_out == rate_in:
        return frames
    out = frames * rate_out // rate_in
    if out * (rate_in % rate_out) + out * (rate_in // rate_out) // rate_out <= frames:
        out += 1
    return out


def audio_parts(messages: list[dict]) -> list[tuple[dict, str]]:
    """(input_audio, where) of every input_audio part, in prompt order; where is the part's path in the body."""
    return [(part.get("input_audio") or {}, where) for part, where in content_parts(messages, (PART_TYPE,))]


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
    samples = resampled_frames(limits.encoder_rate, info.sample_rate, info.frames)
    if samples < limits.min_encoder_samples:
        need_ms = limits.min_encoder_samples * 1000 / limits.encoder_rate
        raise bad_audio(param, f"is too short for the model's audio encoder: {samples:,} samples at "
                               f"{limits.encoder_rate:,} Hz, fewer than the {limits.min_encoder_samples:,} of its one "
                               f"analysis window ({need_ms:g} ms): send at least {need_ms:g} ms of audio",
                        code="audio_too_short")
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
    """A WAV's fmt chunk, and its data chunk's length checked against the bytes that follow it.

    The length is dr_wav's: the data chunk's bytes over bits × channels / 8 (its block-align field is ignored, as
    dr_wav ignores it for whole-byte samples), so the duration is what libmtmd will decode."""
    pos, fmt_chunk = 12, None
    while pos + 8 <= len(data):
        cid, size = data[pos:pos + 4], struct.unpack_from("<I", data, pos + 4)[0]
        body = pos + 8
        if cid == b"fmt ":
            fmt_chunk = struct.unpack_from("<HHIIHH", data, body)
            tag = fmt_chunk[0]
            if tag == 0xFFFE:  # WAVE_FORMAT_EXTENSIBLE: the real format is the sub-format GUID's first two bytes
                if size < 40:
                    raise ValueError("its extensible fmt chunk is cut short")
                tag = struct.unpack_from("<H", data, body + 24)[0]
        elif cid == b"data":
            if fmt_chunk is None:
                raise ValueError("the data chunk comes before the fmt chunk")
            if body + size > len(data):
                raise ValueError(f"the header says {size:,} bytes of samples, the file holds {len(data) - body:,}")
            _, channels, rate, _, _, bits = fmt_chunk
            if not (tag == 1 and bits in (8, 16, 24, 32) or tag == 3 and bits in (32, 64)):
                raise ValueError(f"format tag {tag} with {bits} bits a sample is not PCM")
            if channels == 0 or rate == 0:
                raise ValueError("no channels or no sample rate")
            frames = size // (bits // 8 * channels)
            return AudioInfo("wav", rate, channels, frames / rate, frames)
        pos = body + size + (size & 1)
    raise ValueError("no data chunk")


def _flac_info(data: bytes) -> AudioInfo:
    """A FLAC's STREAMINFO: rate, channels and total samples (a file that does not say its length is refused),
    checked against its last frame: that frame must end where STREAMINFO says and be whole (its CRC-16)."""
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
    block = int.from_bytes(data[8:10], "big")  # STREAMINFO's minimum block size: every frame's in a fixed stream
    max_frame = int.from_bytes(data[8 + 7:8 + 10], "big") or FLAC_FRAME_WINDOW  # 0: the encoder did not say
    depth = ((bits >> 36) & 0x1F) + 1
    held = _flac_samples_held(data, _flac_audio_start(data), block, max_frame, channels, depth)
    if held is None:
        raise ValueError("its last frame is cut short")
    if held < total:
        raise ValueError(f"STREAMINFO says {total:,} samples, the frames hold {held:,}")
    return AudioInfo("flac", rate, channels, total / rate, total)


def _flac_audio_start(data: bytes) -> int:
    """Where the frames begin: after the last metadata block."""
    pos = 4
    while True:
        if pos + 4 > len(data):
            raise ValueError("the metadata blocks are cut short")
        last, size = data[pos] & 0x80, int.from_bytes(data[pos + 1:pos + 4], "big")
        pos += 4 + size
        if last:
            if pos >= len(data):
                raise ValueError("no audio frames after the metadata")
            return pos
        if pos > len(data):
            raise ValueError("the metadata blocks are cut short")


# How far from the end the last frame's header is looked for when STREAMINFO does not say its largest frame.
FLAC_FRAME_WINDOW = 1 << 20


def _flac_samples_held(data: bytes, start: int, fixed_block: int, max_frame: int, channels: int = 8,
                       depth: int = 32) -> int | None:
    """The sample the last frame ends at, where a whole frame ends the file; None where none does.
    The last frame is looked for from the end, within the largest frame's size: a frame header's sync code and
    CRC-8 where the frame's CRC-16 up to the file's end holds (a file cut inside a frame has no whole frame at its
    end; one cut at a frame boundary holds fewer samples than STREAMINFO says).

    Linear in the window: the CRC-16 of every suffix comes from one backward pass (_whole_suffixes), and at most
    MAX_FLAC_CANDIDATES headers are parsed, so a tail of crafted headers costs no more than any other bytes. A
    "frame" longer than its block could be (_flac_frame_bound) is no frame: crafted copies of a header whose CRC-16
    happens to hold over a megabyte are not taken for a 4,096-sample block."""
    floor = max(start, len(data) - max_frame - 16)
    window = data[floor:]
    ends = _whole_suffixes(window)
    sync = np.frombuffer(window, dtype=np.uint8)
    marks = ends[:-1] & (sync[:-1] == 0xFF) & ((sync[1:] & 0xFE) == 0xF8)
    for tried, pos in enumerate(np.flatnonzero(marks)[::-1]):
        if tried == MAX_FLAC_CANDIDATES:
            break
        header = _flac_frame_header(data, floor + int(pos), fixed_block)
        if header is not None and len(data) - floor - int(pos) <= _flac_frame_bound(header[1], channels, depth):
            first_sample, block_size = header
            return first_sample + block_size
    return None


def _flac_frame_bound(block_size: int, channels: int, depth: int) -> int:
    """The most bytes a frame of block_size samples can take: twice its verbatim size (encoders fall back to
    verbatim subframes; a side channel takes one bit more a sample), plus headers."""
    return block_size * channels * (depth + 1) // 4 + 1024


# Frame headers (sync code and a whole-frame CRC-16 to the end) tried before a file is refused: a real file's last
# frame is the first from its end; only a crafted one has more.
MAX_FLAC_CANDIDATES = 64
# FLAC's CRC-16 (x^16 + x^15 + x^2 + 1) has no initial value and no final xor, so a frame that ends the file is one
# whose bytes from its header to the end (its stored CRC included) leave a remainder of 0. Read backwards, the
# suffix's remainder times x^-8 per byte, E(p) = E(p+1)·x^-8 ⊕ b(p), is 0 exactly where crc(data[p:]) is: one table
# step a byte for every start at once, where a CRC over the whole tail per candidate header was quadratic.
_CRC16_POLY = 0x18005
_SUFFIX_BLOCK = 256


@cache
def _x_inverse_tables() -> tuple[np.ndarray, list[int]]:
    """(c → c·x^-8, c → c·x^-8·256) mod FLAC's CRC-16 polynomial, over every 16-bit remainder."""
    c = np.arange(1 << 16, dtype=np.uint32)
    for _ in range(8):
        c = np.where(c & 1, (c ^ _CRC16_POLY) >> 1, c >> 1)
    step = c.astype(np.uint16)
    block = step
    for _ in range(_SUFFIX_BLOCK.bit_length() - 1):  # squared: x^-8 → x^-16 → ... → x^-(8·256)
        block = block[block]
    return step, block.tolist()


def _whole_suffixes(window: bytes) -> np.ndarray:
    """For each position p of window, whether window[p:] is a whole CRC-16 codeword (crc(window[p:]) == 0).

    Blocks of _SUFFIX_BLOCK bytes run side by side (numpy, one step a byte column), then a carry runs from the
    last block to the first (one Python step a block), then each block's positions get their carry."""
    step, block = _x_inverse_tables()
    n = len(window)
    m = -(-n // _SUFFIX_BLOCK) or 1
    pad = m * _SUFFIX_BLOCK - n
    cols = np.zeros(m * _SUFFIX_BLOCK, dtype=np.uint16)
    cols[pad:] = np.frombuffer(window, dtype=np.uint8)
    cols = np.ascontiguousarray(cols.reshape(m, _SUFFIX_BLOCK).T)  # cols[j] is byte j of every block
    acc = np.zeros(m, dtype=np.uint16)
    for j in range(_SUFFIX_BLOCK - 1, -1, -1):
        acc = step[acc] ^ cols[j]
        cols[j] = acc  # the block's own suffix remainder from j (as if the file ended with the block)
    carry, c = [0] * m, 0
    firsts = cols[0].tolist()
    for k in range(m - 1, -1, -1):  # carry[k]: the true remainder where block k + 1 starts
        carry[k] = c
        c = block[c] ^ firsts[k]
    acc = np.array(carry, dtype=np.uint16)
    for j in range(_SUFFIX_BLOCK - 1, -1, -1):
        acc = step[acc]
        cols[j] ^= acc
    return (cols.T.reshape(-1) == 0)[pad:]


def _flac_frame_header(data: bytes, pos: int, fixed_block: int) -> tuple[int, int] | None:
    """(first sample, block size) of a frame header at pos, or None where none is (its CRC-8 decides)."""
    if pos + 6 > len(data) or data[pos + 1] & 0xFE != 0xF8:
        return None
    variable = data[pos + 1] & 1
    size_code, rate_code = data[pos + 2] >> 4, data[pos + 2] & 0xF
    if size_code == 0 or rate_code == 0xF or data[pos + 3] & 1:
        return None
    # The frame or sample number: UTF-8-style, 1 to 7 bytes.
    lead, i = data[pos + 4], pos + 5
    ones = 8 - (~lead & 0xFF).bit_length()  # leading 1 bits: 0 for one byte, else the byte count (2 to 7)
    if ones == 1 or ones > 7:
        return None
    extra = max(ones - 1, 0)
    number = lead & (0xFF >> (ones + 1)) if ones else lead
    for _ in range(extra):
        if i >= len(data) or data[i] & 0xC0 != 0x80:
            return None
        number, i = number << 6 | data[i] & 0x3F, i + 1
    if size_code in (6, 7):
        n = size_code - 5
        block_size, i = int.from_bytes(data[i:i + n], "big") + 1, i + n
    else:
        block_size = 192 if size_code == 1 else 576 << (size_code - 2) if size_code <= 5 else 256 << (size_code - 8)
    i += {12: 1, 13: 2, 14: 2}.get(rate_code, 0)
    if i >= len(data) or _crc8(data[pos:i]) != data[i]:
        return None
    return (number if variable else number * fixed_block), block_size


def _crc8(data: bytes) -> int:
    """FLAC's frame header CRC-8 (polynomial x^8 + x^2 + x + 1)."""
    crc = 0
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc << 1 ^ 0x07) & 0xFF if crc & 0x80 else crc << 1 & 0xFF
    return crc


_CRC16_TABLE = []
for _n in range(256):
    _c = _n << 8
    for _ in range(8):
        _c = (_c << 1 ^ 0x8005) & 0xFFFF if _c & 0x8000 else _c << 1 & 0xFFFF
    _CRC16_TABLE.append(_c)


def _crc16(data: bytes) -> int:
    """FLAC's frame CRC-16 (polynomial x^16 + x^15 + x^2 + 1), by table: a frame can be tens of kilobytes."""
    crc = 0
    for byte in data:
        crc = (crc << 8 & 0xFFFF) ^ _CRC16_TABLE[crc >> 8 ^ byte]
    return crc


# MPEG audio frame header tables: bit rates (kbit/s) by version and layer, sample rates by version.
_MP3_RATES = {3: (44100, 48000, 32000), 2: (22050, 24000, 16000), 0: (11025, 12000, 8000)}
_MP3_KBPS_V1_L3 = (0, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320)
_MP3_KBPS_V2_L3 = (0, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 144, 160)


def _mp3_info(data: bytes) -> AudioInfo:
    """An MP3's frames walked from the first to the last (after an ID3v2 tag): the duration is what they hold, as
    dr_mp3 counts it. A first frame holding a Xing or Info tag is no audio; the frame count it states is what dr_mp3
    sizes the decode by (refused where the file holds fewer frames), less the LAME tag's encoder delay and padding."""
    pos = 0
    if data[:3] == b"ID3":
        size = data[6:10]
        pos = 10 + (size[0] << 21 | size[1] << 14 | size[2] << 7 | size[3])
    rate = channels = 0
    samples = frames = 0
    tag: tuple[int | None, int, int] | None = None
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
        if not frames and tag is None and (found := _mp3_info_tag(data, pos, h, length)) is not None:
            tag = found  # the Info/Xing frame: dr_mp3 skips it
        else:
            samples += per_frame
            frames += 1
        pos += length
    if not frames:
        raise ValueError("no MPEG frames")
    if tag is not None:
        stated, delay, pad = tag
        if stated is not None:
            if stated > frames:
                raise ValueError(f"its Xing header says {stated:,} frames, the file holds {frames:,}")
            samples = stated * per_frame & 0xFFFFFFFF  # dr_mp3 multiplies in 32 bits
        samples = samples - delay if samples >= delay else samples
        samples = samples - pad if samples >= pad else samples
    return AudioInfo("mp3", rate, channels, samples / rate, samples)


def _mp3_info_tag(data: bytes, pos: int, header: int, length: int) -> tuple[int | None, int, int] | None:
    """(frames it states or None, encoder delay, padding) of a Xing/Info tag in the frame at pos, as dr_mp3 reads
    them; None where the frame holds no such tag."""
    mono, mpeg1 = (header >> 6) & 3 == 3, (header >> 19) & 3 == 3
    at = pos + 4 + (0 if header >> 16 & 1 else 2) + ((17 if mono else 32) if mpeg1 else (9 if mono else 17))
    if data[at:at + 4] not in (b"Xing", b"Info") or at + 8 > pos + length:
        return None
    flags, i = data[at + 7], at + 8
    stated = None
    if flags & 1:
        stated, i = int.from_bytes(data[i:i + 4], "big"), i + 4
    i += 4 * bool(flags & 2) + 100 * bool(flags & 4) + 4 * bool(flags & 8)
    delay = pad = 0
    if i < len(data) and data[i]:
        i += 21
        if i - pos + 14 < length and i + 3 <= len(data):
            delay = (data[i] << 4 | data[i + 1] >> 4) + 529
            pad = max(((data[i + 1] & 0xF) << 8 | data[i + 2]) - 529, 0)
    return stated, delay, pad
