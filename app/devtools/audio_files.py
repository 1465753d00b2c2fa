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
