"""The TTS process (`python -m app.speech.worker`): Piper voices spoken on loopback HTTP for serve alone.

One synthesis runs at a time, with the thread budget serve gave the process; between two sentences the next one
spoken is the waiting request's of the best class (lowest priority number, then arrival), so a voice-class
sentence goes before a background reading's next one. Loaded voices are kept (at most MAX_VOICES, least
recently used dropped first) with what their load cost.

`POST /speak` answers a stream of frames, each a kind byte, a 4-byte big-endian length and its payload:
M (JSON: sample rate, format), A (audio bytes in the asked format), D (JSON: audio seconds, synthesis seconds,
sentences), E (JSON: an error after the answer began). `GET /health` reports the loaded voices.
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import json
import os
import struct
import sys
import threading
import time
from collections import OrderedDict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from app.speech import piper_engine
from app.speech.encode import Encoder

KEY_ENV = "HEARTH_TTS_KEY"
MAX_VOICES = 2
MAX_REQUEST_BYTES = 1024 * 1024


def frame(kind: bytes, payload: bytes) -> bytes:
    """One frame of /speak's answer."""
    return kind + struct.pack(">I", len(payload)) + payload


class Gate:
    """One synthesis at a time; the waiting request with the lowest (priority, arrival) goes next."""

    def __init__(self):
        self._cv = threading.Condition()
        self._waiting: list[tuple[int, int]] = []
        self._busy = False
        self._order = itertools.count()

    def enter(self, priority: int) -> None:
        """Wait for the turn of a request of `priority`."""
        with self._cv:
            me = (priority, next(self._order))
            heapq.heappush(self._waiting, me)
            self._cv.wait_for(lambda: not self._busy and self._waiting[0] == me)
            heapq.heappop(self._waiting)
            self._busy = True

    def leave(self) -> None:
        """Give the turn to the next waiting request."""
        with self._cv:
            self._busy = False
            self._cv.notify_all()


class Voices:
    """Loaded voices, least recently used dropped first."""

    def __init__(self, threads: int):
        self.threads = threads
        self._loaded: OrderedDict[str, piper_engine.LoadedVoice] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, job: dict) -> piper_engine.LoadedVoice:
        """The voice `job` names, loaded if it is not (called inside the gate)."""
        key = job["model"]
        with self._lock:
            if key in self._loaded:
                self._loaded.move_to_end(key)
                return self._loaded[key]
        loaded = piper_engine.load(job["name"], job["model"], job["config"], self.threads)
        with self._lock:
            self._loaded[key] = loaded
            while len(self._loaded) > MAX_VOICES:
                self._loaded.popitem(last=False)
        return loaded

    def report(self) -> dict:
        """Each loaded voice's name, rate and load time."""
        with self._lock:
            return {v.name: {"sample_rate": v.sample_rate, "load_s": round(v.load_s, 3), "model": key}
                    for key, v in self._loaded.items()}


class _Handler(BaseHTTPRequestHandler):
    server: SpeechServer
    protocol_version = "HTTP/1.1"

    def log_message(self, format, *args) -> None:  # noqa: A002 - the base class's name
        """Quiet: serve logs the requests."""

    def _authorized(self) -> bool:
        if self.headers.get("Authorization") == f"Bearer {self.server.key}":
            return True
        self._json(401, {"error": "wrong key"})
        return False

    def _json(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        """GET /health."""
        if self.path == "/health" and self._authorized():
            self._json(200, {"status": "ok", "pid": os.getpid(), "threads": self.server.voices.threads,
                             "voices": self.server.voices.report()})
        elif self.path != "/health":
            self._json(404, {"error": "not found"})

    def do_POST(self) -> None:
        """POST /speak."""
        if not self._authorized():
            return
        length = int(self.headers.get("Content-Length") or 0)
        if self.path != "/speak" or not 0 < length <= MAX_REQUEST_BYTES:
            self._json(400, {"error": "POST /speak with a JSON body"})
            return
        job = json.loads(self.rfile.read(length))
        self.server.speak(self, job)


class SpeechServer(ThreadingHTTPServer):
    """The TTS process's loopback server."""

    daemon_threads = True

    def __init__(self, port: int, threads: int, key: str):
        super().__init__(("127.0.0.1", port), _Handler)
        self.key = key
        self.gate = Gate()
        self.voices = Voices(threads)

    def _start(self, handler: _Handler, job: dict) -> tuple[piper_engine.LoadedVoice, list] | None:
        """Load the voice and split the text into sentences, inside the gate; None once an error is answered."""
        self.gate.enter(int(job.get("priority", 0)))
        try:
            loaded = self.voices.get(job["voice"])
            return loaded, piper_engine.sentences(loaded, job["text"])
        except piper_engine.SpeechUnavailable as exc:
            handler._json(503, {"error": str(exc), "code": "tts_not_installed"})
        except ValueError as exc:
            handler._json(400, {"error": str(exc), "code": "voice_broken"})
        finally:
            self.gate.leave()
        return None

    def speak(self, handler: _Handler, job: dict) -> None:
        """Answer /speak: the job's text in its voice and format, a frame per sentence."""
        started = self._start(handler, job)
        if started is None:
            return
        loaded, sentences = started
        handler.send_response(200)
        handler.send_header("Content-Type", "application/octet-stream")
        handler.send_header("Transfer-Encoding", "chunked")
        handler.end_headers()
        fmt = job.get("format", "pcm")
        send = _chunked(handler)
        send(frame(b"M", json.dumps({"sample_rate": loaded.sample_rate, "format": fmt}).encode()))
        encoder = Encoder(fmt, loaded.sample_rate)
        try:
            stats = self._sentences(job, loaded, sentences, encoder, send)
            send(frame(b"A", encoder.close()))
            send(frame(b"D", json.dumps(stats).encode()))
        except (BrokenPipeError, ConnectionError):
            encoder.abort()
            return
        except Exception as exc:  # a synthesis failure after the answer began is told as a frame
            encoder.abort()
            send(frame(b"E", json.dumps({"error": f"synthesis failed: {exc}"}).encode()))
        send(b"")

    def _sentences(self, job: dict, loaded, sentences: list, encoder: Encoder, send) -> dict:
        samples, synth_s = 0, 0.0
        speed, speaker, priority = float(job.get("speed", 1.0)), job.get("speaker"), int(job.get("priority", 0))
        for phonemes in sentences:
            self.gate.enter(priority)
            try:
                began = time.monotonic()
                pcm = piper_engine.speak(loaded, phonemes, speed, speaker)
                synth_s += time.monotonic() - began
            finally:
                self.gate.leave()
            samples += len(pcm) // 2
            send(frame(b"A", encoder.feed(pcm)))
        return {"audio_seconds": samples / loaded.sample_rate, "synthesis_s": synth_s, "sentences": len(sentences),
                "sample_rate": loaded.sample_rate, "voice_load_s": loaded.load_s, "loaded": self.voices.report()}


def _chunked(handler: _Handler):
    def send(data: bytes) -> None:
        """One chunk of the chunked answer (empty: the last)."""
        handler.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        handler.wfile.flush()
    return send


def main(argv: list[str] | None = None) -> int:
    """Serve until killed; prints `ready <port>` once listening."""
    parser = argparse.ArgumentParser(prog="python -m app.speech.worker")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    server = SpeechServer(args.port, args.threads, os.environ.get(KEY_ENV, ""))
    print(f"ready {server.server_address[1]}", flush=True)
    server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
