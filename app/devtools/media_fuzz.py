"""Seeded, bounded hostile media for the fuzz tier (issue 50): WAV, MP3, FLAC, PNG and JPEG variants at boundary
sizes, with lying headers and pathological frame patterns, plus seeded mutations of real files. `variants(seed,
count)` always yields the same files for the same arguments, so a failure names a file anyone can make again.

Nothing here is downloaded: audio comes from app.devtools.audio_files (Python's wave, the Debian flac and lame
encoders), images from Pillow.
"""

from __future__ import annotations

import io
import random
import struct
import zlib
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
from PIL import Image

from app.devtools import audio_files

AUDIO_FORMATS = ("wav", "mp3", "flac")
IMAGE_FORMATS = ("png", "jpeg")


@dataclass(frozen=True)
class Variant:
    """One generated file: its name (what it is built to exercise), its claimed format and its bytes."""

    name: str
    fmt: str
    data: bytes

    @property
    def is_audio(self) -> bool:
        """Whether it goes through the audio routes (else an image part)."""
        return self.fmt in AUDIO_FORMATS


def _wav(frames: int, sample_rate: int = 16000, bits: int = 16, channels: int = 1, **lies: int) -> bytes:
    """A PCM WAV of a sweep whose header fields can lie (tag, rate_field, channels_field, align, bits_field, size)."""
    rate = sample_rate
    pcm = audio_files.sweep_pcm(max(frames / rate, 1 / rate), rate)[:frames]
    body = pcm.astype("<i2").tobytes() if bits == 16 else bytes(frames * bits // 8 * channels)
    size = lies.get("size", len(body))
    align = lies.get("align", bits // 8 * channels)
    fmt = struct.pack("<HHIIHH", lies.get("tag", 1), lies.get("channels_field", channels), lies.get("rate_field", rate),
                      rate * align, align, lies.get("bits_field", bits))
    return b"RIFF" + struct.pack("<I", 36 + len(body)) + b"WAVEfmt " + struct.pack("<I", 16) + fmt + b"data" \
        + struct.pack("<I", size) + body


def _png(width: int, height: int, **lies) -> bytes:
    """A PNG of width × height; IHDR may claim other dimensions, its CRC may be wrong, a chunk storm may follow."""
    raw = b"".join(b"\0" + bytes(3 * min(width, 64)) for _ in range(min(height, 64)))

    def chunk(kind: bytes, data: bytes, crc_ok: bool = True) -> bytes:
        crc = zlib.crc32(kind + data) ^ (0 if crc_ok else 1)
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", crc)

    w, h = lies.get("claim", (min(width, 64), min(height, 64)))
    ihdr = chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0), not lies.get("bad_crc"))
    extra = b"".join(chunk(b"tEXt", b"k\0" + bytes(8)) for _ in range(lies.get("storm", 0)))
    return b"\x89PNG\r\n\x1a\n" + ihdr + extra + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b"")


def _jpeg(width: int, height: int, progressive: bool = False) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (width, height), (120, 30, 200)).save(out, format="JPEG", progressive=progressive, quality=50)
    return out.getvalue()


def _jpeg_claiming(width: int, height: int) -> bytes:
    """A small JPEG whose SOF says width × height."""
    data = bytearray(_jpeg(16, 16))
    at = data.find(b"\xff\xc0")
    if at < 0:
        at = data.find(b"\xff\xc2")
    struct.pack_into(">HH", data, at + 5, height, width)
    return bytes(data)


def fixed_variants() -> list[Variant]:
    """The hand-made cases: boundaries, lying headers, pathological frame patterns."""
    sweep = {fmt: audio_files.sweep(fmt, seconds=1.0) for fmt in AUDIO_FORMATS}
    header = audio_files.flac_frame_header()
    out = [
        Variant("wav-0-bytes", "wav", b""),
        Variant("wav-riff-only", "wav", b"RIFF\0\0\0\0WAVE"),
        Variant("wav-header-no-data", "wav", _wav(0)),
        *(Variant(f"wav-{n}-frames", "wav", _wav(n)) for n in (1, 2, 100, 399, 400, 401)),
        Variant("wav-8k-199-frames", "wav", _wav(199, sample_rate=8000)),
        Variant("wav-size-lies-2GB", "wav", _wav(1600, size=2**31 - 64)),
        Variant("wav-size-ffffffff", "wav", _wav(1600, size=0xFFFFFFFF)),
        Variant("wav-align-65535", "wav", _wav(16000, align=65535)),
        Variant("wav-align-0", "wav", _wav(16000, align=0)),
        Variant("wav-channels-0", "wav", _wav(1600, channels_field=0)),
        Variant("wav-channels-255", "wav", _wav(1600, channels_field=255)),
        Variant("wav-rate-0", "wav", _wav(1600, rate_field=0)),
        Variant("wav-rate-1", "wav", _wav(1600, rate_field=1)),
        Variant("wav-rate-4e9", "wav", _wav(1600, rate_field=4_000_000_000)),
        Variant("wav-bits-12", "wav", _wav(1600, bits_field=12)),
        Variant("wav-bits-0", "wav", _wav(1600, bits_field=0)),
        Variant("wav-adpcm-tag", "wav", _wav(1600, tag=2)),
        Variant("wav-float-16-bits", "wav", _wav(1600, tag=3)),
        Variant("flac-frame-headers-8k", "flac", audio_files.frame_header_flac(8_000)),
        Variant("flac-frame-headers-130k", "flac", audio_files.frame_header_flac(130_000)),
        Variant("flac-sync-storm", "flac", audio_files.flac_streaminfo(4096) + b"\xff\xf8" * 40_000),
        Variant("flac-streaminfo-only", "flac", audio_files.flac_streaminfo(4096)),
        Variant("flac-total-0", "flac", audio_files.flac_streaminfo(0) + header + b"\0\0"),
        Variant("flac-total-huge", "flac", audio_files.flac_streaminfo((1 << 36) - 1) + sweep["flac"][42:]),
        Variant("flac-one-header", "flac", audio_files.flac_streaminfo(4096) + header),
        Variant("mp3-one-byte", "mp3", b"\xff"),
        Variant("mp3-id3-only", "mp3", b"ID3\x04\0\0\0\0\0\0"),
        Variant("mp3-id3-size-lies", "mp3", b"ID3\x04\0\0\x7f\x7f\x7f\x7f" + sweep["mp3"]),
        Variant("mp3-header-storm", "mp3", b"\xff\xfb\x10\xc4" * 50_000),
        Variant("mp3-first-frame-only", "mp3", sweep["mp3"][:200]),
        Variant("png-1x1", "png", _png(1, 1)),
        Variant("png-claims-65535-square", "png", _png(8, 8, claim=(65535, 65535))),
        Variant("png-claims-0x0", "png", _png(8, 8, claim=(0, 0))),
        Variant("png-bad-ihdr-crc", "png", _png(8, 8, bad_crc=True)),
        Variant("png-chunk-storm", "png", _png(8, 8, storm=20_000)),
        Variant("png-signature-only", "png", b"\x89PNG\r\n\x1a\n"),
        Variant("jpeg-1x1", "jpeg", _jpeg(1, 1)),
        Variant("jpeg-claims-65500-square", "jpeg", _jpeg_claiming(65500, 65500)),
        Variant("jpeg-claims-0-wide", "jpeg", _jpeg_claiming(0, 16)),
        Variant("jpeg-progressive-truncated", "jpeg", _jpeg(256, 256, progressive=True)[:600]),
        Variant("jpeg-soi-only", "jpeg", b"\xff\xd8"),
    ]
    # The Xing frame count lying high (dr_mp3 sizes its decode by it).
    xing = bytearray(sweep["mp3"])
    at = xing.find(b"Info")
    if at > 0 and xing[at + 7] & 1:
        xing[at + 8:at + 12] = (0xFFFFFFFF).to_bytes(4, "big")
        out.append(Variant("mp3-xing-count-lies", "mp3", bytes(xing)))
    return out


def mutated(base: Variant, rng: random.Random) -> Variant:
    """A seeded mutation of a real file: cut, bytes flipped, a run duplicated or a header field rewritten."""
    data = bytearray(base.data)
    kind = rng.choice(("cut", "flip", "dup", "field"))
    if kind == "cut" and len(data) > 1:
        data = data[:rng.randrange(1, len(data))]
    elif kind == "flip":
        for _ in range(rng.randint(1, 16)):
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
    elif kind == "dup" and len(data) > 8:
        start = rng.randrange(len(data) - 4)
        run = data[start:start + rng.randint(2, 64)]
        data[start:start] = run * rng.randint(1, 200)
    else:
        at = rng.randrange(min(len(data), 64))
        data[at:at + 4] = rng.choice((b"\xff\xff\xff\xff", b"\0\0\0\0", b"\x7f\xff\xff\xff", b"\x80\0\0\0"))
    return Variant(f"{base.name}-{kind}-{rng.getrandbits(24):06x}", base.fmt, bytes(data))


def real_files() -> list[Variant]:
    """Whole, valid files of each format: the bases mutations start from."""
    files = [Variant(f"{fmt}-sweep", fmt, audio_files.sweep(fmt, seconds=1.0)) for fmt in AUDIO_FORMATS]
    rng = np.random.default_rng(0)
    pixels = Image.fromarray(rng.integers(0, 255, (48, 64, 3), dtype=np.uint8))
    for fmt in IMAGE_FORMATS:
        out = io.BytesIO()
        pixels.save(out, format=fmt.upper())
        files.append(Variant(f"{fmt}-noise", fmt, out.getvalue()))
    return files


def variants(seed: int = 0, count: int = 60) -> Iterator[Variant]:
    """The fixed cases, then `count` seeded mutations of real files (the same for the same seed)."""
    yield from fixed_variants()
    rng = random.Random(seed)
    bases = real_files()
    for _ in range(count):
        yield mutated(rng.choice(bases), rng)
