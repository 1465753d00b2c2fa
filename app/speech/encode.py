"""The speech API's output formats, written a sentence at a time as the PCM comes (in the TTS process).

- `pcm`: raw 16-bit little-endian mono at 24 kHz, as OpenAI's speech API sends it (clients play it at 24 kHz), so
  the voice's own rate is resampled (linear interpolation, per sentence: each sentence is a clip of its own).
- `wav`: the voice's rate, a header first whose sizes say "unknown" (0xFFFFFFFF, as streamed WAV is written), then
  the samples as they come.
- `mp3` and `flac`: the `lame` and `flac` command-line encoders (Debian's packages, already needed for speech in),
  fed through a pipe, their output passed on as they write it.
- `raw` (Wyoming's, not the API's): the voice's own PCM as Piper writes it, at its own rate.
- `opus`: Ogg Opus written by libsndfile (Debian's libsndfile1, with libopus and libogg; no command-line encoder is
  needed), through ctypes and its virtual I/O: the pages are handed on as libsndfile writes them (it never seeks
  back in an Ogg stream). Opus takes 8, 12, 16, 24 or 48 kHz: the voice is resampled to 24 kHz. Where libsndfile
  cannot write Ogg Opus, the gateway refuses the format with a 400 naming what to install.
"""

from __future__ import annotations

import queue
import shutil
import struct
import subprocess
import threading

import numpy as np

from app.speech import sndfile

PCM_RATE = 24000
CONTENT_TYPES = {"wav": "audio/wav", "mp3": "audio/mpeg", "flac": "audio/flac", "opus": "audio/ogg; codecs=opus",
                 "pcm": "audio/pcm"}
# Which command writes each piped format; a format whose command is missing is refused before any synthesis.
ENCODER_COMMANDS = {"mp3": "lame", "flac": "flac"}
_UNKNOWN = 0xFFFFFFFF
OPUS_RATE = 24000


def available(fmt: str) -> bool:
    """Whether this machine can write `fmt`."""
    if fmt == "opus":
        return sndfile.opus_writable()
    command = ENCODER_COMMANDS.get(fmt)
    return command is None or shutil.which(command) is not None


def wav_header(rate: int) -> bytes:
    """A streamed WAV's header: 16-bit mono PCM at `rate`, its sizes unknown."""
    return b"RIFF" + struct.pack("<I", _UNKNOWN) + b"WAVEfmt " + struct.pack(
        "<IHHIIHH", 16, 1, 1, rate, rate * 2, 2, 16) + b"data" + struct.pack("<I", _UNKNOWN)


def resample(pcm: bytes, rate: int, to_rate: int) -> bytes:
    """16-bit mono PCM from `rate` to `to_rate`, by linear interpolation."""
    if rate == to_rate or not pcm:
        return pcm
    samples = np.frombuffer(pcm, dtype="<i2").astype(np.float32)
    n = max(1, round(len(samples) * to_rate / rate))
    out = np.interp(np.arange(n) * (rate / to_rate), np.arange(len(samples)), samples)
    return np.clip(np.rint(out), -32768, 32767).astype("<i2").tobytes()


class Encoder:
    """PCM in (`feed`, then `close`), the format's bytes out as soon as there are any."""

    def __init__(self, fmt: str, rate: int):
        self.fmt, self.rate = fmt, rate
        self._proc: subprocess.Popen | None = None
        self._out: queue.Queue[bytes | None] = queue.Queue()
        self._started = False
        self._opus = sndfile.OggOpusWriter(OPUS_RATE) if fmt == "opus" else None
        if fmt in ENCODER_COMMANDS:
            self._proc = subprocess.Popen(_command(fmt, rate), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                          stderr=subprocess.DEVNULL)
            threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        while chunk := self._proc.stdout.read1(65536):
            self._out.put(chunk)
        self._out.put(None)

    def feed(self, pcm: bytes) -> bytes:
        """One sentence's PCM; what the format has to send now."""
        head = b""
        if not self._started:
            self._started = True
            head = wav_header(self.rate) if self.fmt == "wav" else b""
        if self.fmt == "pcm":
            return resample(pcm, self.rate, PCM_RATE)
        if self._opus is not None:
            return self._opus.write(resample(pcm, self.rate, OPUS_RATE))
        if self._proc is None:
            return head + pcm
        assert self._proc.stdin is not None
        self._proc.stdin.write(pcm)
        self._proc.stdin.flush()
        return self._ready()

    def _ready(self) -> bytes:
        parts = []
        while True:
            try:
                chunk = self._out.get_nowait()
            except queue.Empty:
                return b"".join(parts)
            if chunk is None:
                self._out.put(None)
                return b"".join(parts)
            parts.append(chunk)

    def close(self) -> bytes:
        """The rest of the file, once the last sentence is in."""
        if self._opus is not None:
            return self._opus.close()
        if self._proc is None:
            return wav_header(self.rate) if self.fmt == "wav" and not self._started else b""
        assert self._proc.stdin is not None
        self._proc.stdin.close()
        parts = []
        while (chunk := self._out.get()) is not None:
            parts.append(chunk)
        self._proc.wait()
        return b"".join(parts)

    def abort(self) -> None:
        """Stop the encoder (the client left)."""
        if self._opus is not None:
            self._opus.close()
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()


def _command(fmt: str, rate: int) -> list[str]:
    if fmt == "mp3":
        return ["lame", "--quiet", "-r", "-s", f"{rate / 1000:g}", "--bitwidth", "16", "--signed", "--little-endian",
                "-m", "m", "-", "-"]
    return ["flac", "--silent", "--force-raw-format", "--endian=little", "--sign=signed", "--channels=1",
            "--bps=16", f"--sample-rate={rate}", "-c", "-"]
