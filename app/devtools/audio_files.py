"""Generated audio for tests and benches: a sine sweep as WAV (Python's wave), and as FLAC and MP3 through the
Debian `flac` and `lame` encoders, so no audio file is downloaded or committed."""

from __future__ import annotations

import io
import shutil
import subprocess
import tempfile
import wave
from pathlib import Path

import numpy as np

FORMATS = ("wav", "mp3", "flac")


def sweep_pcm(seconds: float = 2.0, rate: int = 16000, f0: float = 200.0, f1: float = 2000.0) -> np.ndarray:
    """A linear sine sweep from f0 to f1 Hz, int16 mono at rate, at half scale."""
    t = np.arange(int(seconds * rate)) / rate
    phase = 2 * np.pi * (f0 * t + (f1 - f0) * t * t / (2 * seconds))
    return (0.5 * 32767 * np.sin(phase)).astype(np.int16)


def wav_bytes(pcm: np.ndarray, rate: int = 16000, channels: int = 1) -> bytes:
    """int16 samples (interleaved where channels > 1) as a WAV file."""
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(pcm.astype("<i2").tobytes())
    return out.getvalue()


def encoders_missing() -> list[str]:
    """The encoder programs that are not installed (Debian packages flac and lame)."""
    return [name for name in ("flac", "lame") if shutil.which(name) is None]


def encode(wav: bytes, fmt: str) -> bytes:
    """A WAV file's audio as wav, flac (flac, lossless) or mp3 (lame, 64 kbit/s CBR)."""
    if fmt == "wav":
        return wav
    with tempfile.TemporaryDirectory() as d:
        src, dst = Path(d) / "in.wav", Path(d) / f"out.{fmt}"
        src.write_bytes(wav)
        if fmt == "flac":
            cmd = ["flac", "--silent", "--force", "-o", str(dst), str(src)]
        elif fmt == "mp3":
            cmd = ["lame", "--quiet", "-b", "64", "--cbr", str(src), str(dst)]
        else:
            raise ValueError(f"unknown audio format {fmt!r}; choose from {', '.join(FORMATS)}")
        subprocess.run(cmd, check=True, capture_output=True)
        return dst.read_bytes()


def sweep(fmt: str = "wav", seconds: float = 2.0, rate: int = 16000) -> bytes:
    """A sine sweep of this length as a file of this format."""
    return encode(wav_bytes(sweep_pcm(seconds, rate), rate), fmt)


def lying_wav(seconds: float = 2.0, claimed_bytes: int = 2**31 - 64) -> bytes:
    """A WAV whose header claims far more data than the file holds (a header that lies)."""
    data = bytearray(wav_bytes(sweep_pcm(seconds)))
    data[4:8] = (claimed_bytes + 36).to_bytes(4, "little")
    data[40:44] = claimed_bytes.to_bytes(4, "little")
    return bytes(data)


def _flac_crc8(data: bytes) -> int:
    crc = 0
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc << 1 ^ 0x07) & 0xFF if crc & 0x80 else crc << 1 & 0xFF
    return crc


def flac_streaminfo(total_samples: int, rate: int = 16000, max_frame: int = (1 << 24) - 1, block: int = 4096) -> bytes:
    """"fLaC" and one STREAMINFO block marked last: no frames yet."""
    bits = rate << 44 | 0 << 41 | 15 << 36 | total_samples  # mono, 16 bits a sample
    info = block.to_bytes(2, "big") * 2 + (0).to_bytes(3, "big") + max_frame.to_bytes(3, "big") \
        + bits.to_bytes(8, "big") + bytes(16)
    return b"fLaC" + bytes([0x80, 0, 0, 34]) + info


def flac_frame_header(frame_number: int = 0) -> bytes:
    """A 6-byte FLAC frame header (fixed 4,096-sample blocks, the rate and depth of STREAMINFO) with its CRC-8."""
    head = bytes([0xFF, 0xF8, 0xC0, 0x00, frame_number & 0x7F])
    return head + bytes([_flac_crc8(head)])


def frame_header_flac(size: int) -> bytes:
    """The FLAC of issue 50's attack, about `size` bytes: a valid STREAMINFO (marked last, largest frame 16 MiB),
    then copies of one frame header whose CRC-8 is right, then two zero bytes; no frame is whole, and a check that
    ran a CRC-16 over the whole tail for each header took minutes."""
    head = flac_streaminfo(4096)
    header = flac_frame_header()
    return head + header * max(1, (size - len(head) - 2) // len(header)) + b"\0\0"
