"""Serve's handle on the TTS process: started on first use, restarted when it has died, spoken to over loopback.

The process (app.speech.worker) runs Piper with a thread budget of its own, so a sentence never runs on serve's
event loop and a crash in onnxruntime or espeak-ng costs one request, not serve: the next request starts a fresh
process. Its key is random per start, so only serve (and its user) can reach it.
"""

from __future__ import annotations

import http.client
import json
import os
import secrets
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from app.speech import encode
from app.speech.voices import Voice, all_voices
from app.speech.worker import KEY_ENV

START_TIMEOUT_S = 60.0
READ_TIMEOUT_S = 300.0


class SpeechFailed(Exception):
    """The TTS process could not be started or reached, or it failed mid-answer."""


class SpeechRefused(Exception):
    """The TTS process refused the job (a voice it cannot load, Piper not installed): its status and reason."""

    def __init__(self, status: int, message: str, code: str):
        super().__init__(message)
        self.status, self.code = status, code


@dataclass
class Frame:
    """One piece of the TTS process's answer: kind M (meta), A (audio), D (done), E (error)."""

    kind: str
    payload: bytes

    def json(self) -> dict:
        """A meta, done or error frame's JSON."""
        return json.loads(self.payload)


def available_formats(formats: tuple[str, ...]) -> list[str]:
    """Those of `formats` this machine can write."""
    return [f for f in formats if encode.available(f)]


def default_threads() -> int:
    """Half the cores, at least one: the other half stays the LLM's."""
    return max(1, (os.cpu_count() or 2) // 2)


class SpeechProcess:
    """The TTS process, started on demand and restarted after a crash."""

    def __init__(self, threads: Callable[[], int] = default_threads):
        self._threads = threads
        self._proc: subprocess.Popen | None = None
        self._port = 0
        self._key = ""
        self._lock = threading.Lock()
        self.starts = 0
        # What the process last said it holds (name → load_s, ...), and each voice's last real-time factor.
        self._loaded: dict[str, dict] = {}
        self.rtf: dict[str, float] = {}
        self.last_used_s = 0.0
        self.in_flight = 0  # jobs whose frames are still being read: the idle stop waits for them

    @property
    def threads(self) -> int:
        """The thread budget the process gets at its next start."""
        return self._threads()

    @property
    def pid(self) -> int | None:
        """The running process's id, if one runs."""
        return self._proc.pid if self._proc is not None and self._proc.poll() is None else None

    def loaded(self) -> dict[str, dict]:
        """The voices the running process holds (empty while none runs), by name: sample rate and load time."""
        return dict(self._loaded) if self.pid is not None else {}

    def _ensure(self) -> tuple[int, str]:
        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                self._loaded = {}
                self._start()
            self.last_used_s = time.monotonic()
            return self._port, self._key

    def _done(self, voice: Voice, stats: dict) -> None:
        """Note what a finished job says: the voices held now, the voice's real-time factor."""
        self._loaded = dict(stats.get("loaded") or {})
        if stats.get("audio_seconds"):
            self.rtf[voice.name] = float(stats["synthesis_s"]) / float(stats["audio_seconds"])
        self.last_used_s = time.monotonic()

    def _start(self) -> None:
        if self._proc is not None:
            self._proc.wait()
        key = secrets.token_urlsafe(32)
        env = {**os.environ, KEY_ENV: key}
        proc = subprocess.Popen([sys.executable, "-m", "app.speech.worker", "--threads", str(self._threads())],
                                stdout=subprocess.PIPE, env=env)
        assert proc.stdout is not None
        line = proc.stdout.readline().decode(errors="replace").split()
        if len(line) != 2 or line[0] != "ready":
            proc.kill()
            proc.wait()
            raise SpeechFailed(f"the TTS process did not start (it said {' '.join(line)[:200]!r})")
        proc.stdout.close()
        self._proc, self._port, self._key = proc, int(line[1]), key
        self.starts += 1

    def health(self) -> dict:
        """The process's report (loaded voices, their load times), starting it if needed."""
        port, key = self._ensure()
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=START_TIMEOUT_S)
        try:
            conn.request("GET", "/health", headers={"Authorization": f"Bearer {key}"})
            return json.loads(conn.getresponse().read())
        except (OSError, http.client.HTTPException, ValueError) as exc:
            raise SpeechFailed(f"the TTS process did not answer: {exc}") from None
        finally:
            conn.close()

    def speak(self, voice: Voice, text: str, fmt: str, speed: float = 1.0, priority: int = 0,
              speaker: int | None = None) -> Iterator[Frame]:
        """The job's frames as the TTS process writes them; SpeechRefused before the first, SpeechFailed at any."""
        port, key = self._ensure()
        body = json.dumps({"voice": voice.job(), "text": text, "format": fmt, "speed": speed, "priority": priority,
                           "speaker": speaker}).encode()
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=READ_TIMEOUT_S)
        try:
            conn.request("POST", "/speak", body, {"Authorization": f"Bearer {key}",
                                                  "Content-Type": "application/json"})
            resp = conn.getresponse()
        except (OSError, http.client.HTTPException) as exc:
            conn.close()
            raise SpeechFailed(f"the TTS process failed ({exc}); it is restarted on the next request") from None
        if resp.status != 200:
            answer = _json(resp.read())
            conn.close()
            raise SpeechRefused(resp.status, str(answer.get("error") or f"HTTP {resp.status}"),
                                str(answer.get("code") or "tts_refused"))
        self.in_flight += 1
        return _frames(conn, resp, lambda stats: self._done(voice, stats), self._ended)

    def _ended(self) -> None:
        self.in_flight -= 1
        self.last_used_s = time.monotonic()

    def stop(self) -> None:
        """End the process (serve is stopping)."""
        with self._lock:
            if self._proc is not None and self._proc.poll() is None:
                self._proc.terminate()
                try:
                    self._proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    self._proc.kill()
                    self._proc.wait()


def _json(raw: bytes) -> dict:
    try:
        out = json.loads(raw)
    except ValueError:
        return {}
    return out if isinstance(out, dict) else {}


def _frames(conn: http.client.HTTPConnection, resp: http.client.HTTPResponse,
            on_done: Callable[[dict], None], on_end: Callable[[], None]) -> Iterator[Frame]:
    try:
        while True:
            head = resp.read(5)
            if not head:
                return
            if len(head) < 5:
                raise SpeechFailed("the TTS process's answer broke off")
            kind, n = head[:1].decode(), struct.unpack(">I", head[1:])[0]
            payload = resp.read(n) if n else b""
            if len(payload) < n:
                raise SpeechFailed("the TTS process's answer broke off")
            if kind == "D":
                on_done(json.loads(payload))
            yield Frame(kind, payload)
    except (OSError, http.client.HTTPException) as exc:
        raise SpeechFailed(f"the TTS process failed mid-answer ({exc}); it is restarted on the next request") from None
    finally:
        conn.close()
        on_end()



class Speech:
    """Serve's speech service: the voices it has (the embedded one first, the default) and the process that speaks."""

    def __init__(self, models_dir: Callable[[], Path | None], threads: Callable[[], int | None] = lambda: None,
                 keep_alive_s: Callable[[], float] = lambda: 600.0):
        self.process = SpeechProcess(lambda: threads() or default_threads())
        self._models_dir = models_dir
        self._keep_alive_s = keep_alive_s

    def voices(self) -> list[Voice]:
        """Every voice, broken ones with their error."""
        return all_voices(self._models_dir())

    def find(self, name: str | None) -> Voice | None:
        """The usable voice of that name; None for the default: the first usable voice."""
        usable = [v for v in self.voices() if v.error is None]
        if name is None:
            return usable[0] if usable else None
        return next((v for v in usable if v.name == name), None)

    def resident_bytes(self) -> int:
        """What the voices the TTS process holds cost in RAM (their estimates): counted in the models' budget."""
        loaded = self.process.loaded()
        if not loaded:
            return 0
        return sum(v.estimate_bytes() for v in self.voices() if v.name in loaded)

    def expire_idle(self) -> bool:
        """End the TTS process once it has been idle its keep-alive (its voices' RAM goes back); whether it was."""
        if self.process.pid is None or self.process.in_flight \
                or time.monotonic() - self.process.last_used_s < self._keep_alive_s():
            return False
        self.process.stop()
        return True

    def stop(self) -> None:
        """End the TTS process."""
        self.process.stop()
